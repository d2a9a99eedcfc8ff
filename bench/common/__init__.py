"""Helpers shared by several benchmarks: the corpus, load generators, processes, models, paths."""
