"""The engine in process: idle time and planning cost per step (`bench engine`), the planner
alone (`bench planner`), prefix caching (`bench prefix`), CPU threads per step
(`bench step-threads`).
"""
