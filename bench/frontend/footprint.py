"""What each process costs: the command line's answer times, every server process's memory, and
the modules one request runs.

Run from the repository root: `python -m bench footprint [--rounds 5]`.

- **The command line**: wall time of `poolserve --help`, `poolserve serve --help`, argument
  errors (a bad value, an unknown flag) and start-up errors found before any process starts (a
  model folder that does not exist, a Hub id not in the cache with HF_HUB_OFFLINE=1), each a
  fresh interpreter, median of the rounds; and the time from the command to a ready server on
  the embedded MiniLM (`/ready` answers 200), with one process and with the default supervisor.
- **Memory**: `poolserve serve --api-server-count 2` on the embedded MiniLM; once ready and after
  one embedding request, the resident set (RSS) of the supervisor, the engine core and each
  front end, read from /proc.
- **The walk**: every function call of one `POST /v1/embeddings` after warm-up, traced in one
  process (`--api-server-count 0`: the front end and the engine core on one loop; the model's
  forward runs in the engine's worker thread, which is not traced); the modules that ran, by
  package.

Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from bench.common.procs import free_port, spawn, wait_for
from bench.common.repo import RESULTS_DIR, source_revision

CLI_CASES = {
    "`poolserve --help`": ["--help"],
    "`poolserve serve --help`": ["serve", "--help"],
    "argument error (`serve --max-num-seqs -3`)": ["serve", "--max-num-seqs", "-3"],
    "unknown flag (`serve --max-model-lenn 5`)": ["serve", "--max-model-lenn", "5"],
    "start error: no such model folder (`serve /models/none`)": ["serve", "/models/none"],
    "start error: Hub id not cached, HF_HUB_OFFLINE=1 (`serve org/none`)": ["serve", "org/none"],
}
# the time to a ready server, by --api-server-count
READY_CASES = {"one process (`--api-server-count 0`)": "0", "supervisor and one front end": "1"}
BODY = {"input": "a short sentence to embed", "model": "sentence-transformers/all-MiniLM-L6-v2"}


def cli_times(rounds: int) -> dict[str, float]:
    """Median wall seconds of each command line case, a fresh interpreter each time."""
    times: dict[str, list[float]] = {case: [] for case in CLI_CASES}
    for _ in range(rounds):
        for case, args in CLI_CASES.items():
            started = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "poolserve", *args],
                capture_output=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            times[case].append(time.perf_counter() - started)
    return {case: statistics.median(seconds) for case, seconds in times.items()}


def ready_times(rounds: int) -> dict[str, float]:
    """Median seconds from `poolserve serve` to /ready answering 200, on the embedded MiniLM."""
    times: dict[str, list[float]] = {case: [] for case in READY_CASES}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for _ in range(rounds):
        for case, count in READY_CASES.items():
            port = free_port()
            command = [sys.executable, "-m", "poolserve", "serve", "--port", str(port)]
            command += ["--api-server-count", count]
            started = time.perf_counter()
            with spawn(command, RESULTS_DIR / "footprint-ready.log"):
                wait_for(lambda port=port: _ready(port), 300, "the server's /ready")
                times[case].append(time.perf_counter() - started)
    return {case: statistics.median(seconds) for case, seconds in times.items()}


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _rss_mib(pid: int) -> float:
    """Resident set of one process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def _children(pid: int) -> list[int]:
    """The direct children of a process."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(child) for child in text.split()]


def _role(pid: int) -> str:
    """A supervisor child's role: `core` or `api` (its first argument)."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return "engine core" if b"core" in argv else "front end"


def process_memory() -> list[tuple[str, float, float]]:
    """(process, RSS once ready, RSS after a request) of each process of a 2-front-end server."""
    port = free_port()
    command = [sys.executable, "-m", "poolserve", "serve", "--port", str(port)]
    command += ["--api-server-count", "2"]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    with spawn(command, RESULTS_DIR / "footprint-server.log") as server:

        def ready() -> bool:
            try:
                return httpx.get(f"{url}/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 300, "the server's /ready")
        pids = {server.pid: "supervisor"} | {c: _role(c) for c in _children(server.pid)}
        before = {pid: _rss_mib(pid) for pid in pids}
        httpx.post(f"{url}/v1/embeddings", json=BODY, timeout=30).raise_for_status()
        time.sleep(0.5)
        after = {pid: _rss_mib(pid) for pid in pids}
    return [(pids[pid], before[pid], after[pid]) for pid in pids]


def request_walk() -> collections.Counter[str]:
    """Calls per poolserve module during one POST /v1/embeddings after warm-up (in process)."""
    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    calls: collections.Counter[str] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        name = str(frame.f_globals.get("__name__", ""))
        if event == "call" and name.startswith("poolserve"):
            calls[name] += 1

    async def run() -> None:
        app = create_app(ServerSettings(api_server_count=0))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://poolserve"
            ) as client:
                for _ in range(3):
                    (await client.post("/v1/embeddings", json=BODY)).raise_for_status()
                threading.settrace(tracer)  # type: ignore[arg-type]
                sys.settrace(tracer)
                try:
                    (await client.post("/v1/embeddings", json=BODY)).raise_for_status()
                    await asyncio.sleep(0.2)  # the core's delivery of the step
                finally:
                    sys.settrace(None)
                    threading.settrace(None)

    asyncio.run(run())
    return calls


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def main(argv: list[str] | None = None) -> None:
    """Measure and print the three tables."""
    parser = argparse.ArgumentParser(prog="python -m bench footprint")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the command line times")
    args = parser.parse_args(argv)
    print(f"revision {source_revision()}\n")
    print("| command | median wall (s) |\n|---|---:|")
    for case, seconds in cli_times(args.rounds).items():
        print(f"| {case} | {seconds:.2f} |")
    print("\n| embedded MiniLM, command to /ready | median wall (s) |\n|---|---:|")
    for case, seconds in ready_times(max(1, args.rounds // 2)).items():
        print(f"| {case} | {seconds:.2f} |")
    print("\n| process | RSS ready (MiB) | RSS after a request (MiB) |\n|---|---:|---:|")
    for role, before, after in process_memory():
        print(f"| {role} | {before:.0f} | {after:.0f} |")
    calls = request_walk()
    packages = collections.Counter(_package(m) for m in calls)
    print(f"\n{len(calls)} modules in {len(packages)} packages run one POST /v1/embeddings:\n")
    print("| package | modules |\n|---|---:|")
    for package, count in sorted(packages.items()):
        print(f"| {package} | {count} |")
