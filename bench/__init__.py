"""Benchmarks (not tests): `python -m bench PART` runs one (bench/__main__.py lists the parts).

One folder per thing measured; helpers shared by several benchmarks live in common/:

    common/     corpus (prompts, texts), loadgen (async HTTP load), wrk, procs (ports, server
                processes), repo (root, results folder, revision), models (the random decoder),
                plotting
    peers/      what poolserve is measured against: offline peers in child processes, the
                FastAPI + sentence-transformers app, the CPU runtimes, Infinity's environment
    offline/    `offline` (cpu.py), the CUDA run (gpu.sh, gpu.py), model FLOPs (efficiency.py),
                `static`, `lora`, `images` (CLIP's image tower against transformers)
    served/     `served` (embeddings*.py), `token` (token_level.py), `rerank`, `models`,
                `images-served` (images*.py)
    frontend/   `frontend` (sequential.py), `frontend-interleaved`, `footprint`, `api-keys`
                (api_keys.py); the floor, servers, report
    engine/     `engine` (loop.py), `planner`, `prefix` (prefix_cache.py), `step-threads`
    precision/  `precision` (fidelity.py), `cpu-peers`
    jobs/       `embed-job` (embed.py), `ray-embed` (ray_data.py)
    fleet/      `fleet` (haproxy.py), `fleet-ray` (ray_serve.py); replicas and load, also for tests
    soak/       `soak` (saturation.py), its clients (load.py) and summary (report.py)

Results: docs/benchmarks.md; run outputs go to bench/results/ (git-ignored).
"""
