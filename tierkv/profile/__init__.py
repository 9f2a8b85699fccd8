"""Measurement: Chrome/Perfetto traces, summaries and plots, access traces, link probes.

The events they read are `tierkv.events` (the bottom of the tree); replay and tuning over access
traces are `tierkv.tune`.
"""
