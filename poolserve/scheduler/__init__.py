"""Request lifecycle: requests, admission, KV blocks, batch planner, engine loop, runner."""
