"""Tracing: spans for every stage step, their sinks and summaries, and the data-stall meter."""
