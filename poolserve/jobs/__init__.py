"""Jobs: a model run over files from the command line, on the Python API (poolserve.offline)."""
