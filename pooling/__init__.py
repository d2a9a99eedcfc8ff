"""Pooling methods, heads, tasks and per-request chunk state."""
