"""Per-request cost of the HTTP front ends on a near-free model, driven by wrk: servers one at a
time (`bench frontend`) or all up at once taking turns (`bench frontend-interleaved`)."""
