"""Measurement: events, Chrome/Perfetto traces, summaries and plots, access traces and replay."""
