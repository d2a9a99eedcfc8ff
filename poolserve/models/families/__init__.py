"""One module per model family: its switch rows, tensor names, MLM heads and config quirks.

models/registry.py assembles the tables from them; the forwards they switch stay shared.
"""
