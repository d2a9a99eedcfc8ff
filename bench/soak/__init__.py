"""One server at saturation for minutes (`bench soak`): memory, errors and latency drift."""
