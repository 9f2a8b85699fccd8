"""Measurement: events, and (later) traces, summaries and replay."""
