"""Replicas under load: behind HAProxy (`bench fleet`, also used by tests/deploy) and under Ray
Serve (`bench fleet-ray`)."""
