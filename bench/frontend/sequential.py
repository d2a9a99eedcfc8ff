"""Front-end benchmark: what one request costs poolserve, Infinity and a bare FastAPI app.

Run from the repository root: `python -m bench frontend [--quick] [--servers a,b]`. The model is
near-free (a random 1-layer, hidden-32 BERT with MiniLM's real tokenizer and sentence-transformers
files), so what is measured is each server's per-request path: HTTP, parsing, tokenization,
scheduling, encoding. Servers, each a real process on loopback, one at a time:

- `poolserve`: `poolserve serve DIR`, with `--api-server-count 1` when the flag exists;
- `poolserve-2fe`: `--api-server-count 2` (engine core + two front ends), "not available" while
  `poolserve serve --help` does not list the flag;
- `poolserve-inproc` (only when named in `--servers`): `--api-server-count 0`, the engine in a
  thread of the one process;
- `infinity`: Infinity 0.0.78 on the same directory, started as `python -m bench served` starts
  it (its environment: `bash bench/peers/infinity_env.sh`; without it the row says so);
- `floor`: `bench.frontend.floor`, FastAPI + orjson answering a constant embedding.

Load: Debian's `wrk` (one thread) POSTs one 14-word text per request at concurrencies 1/16/64/256,
10 s per point, after an untimed warm-up per server start. CPU per request is the user + system
time of the server's whole process tree over the point, over the requests wrk completed. Full runs
take two rounds, the second in reverse server order, and report medians. Servers inherit this
process's environment (so `OMP_WAIT_POLICY=PASSIVE python -m bench frontend` reaches them all).
Writes bench/results/frontend_<mode>.json and .md; a full run draws docs/bench_frontend.png.
Helpers: bench/frontend/servers.py (model, commands), bench/common/wrk.py, bench/frontend/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.common import procs
from bench.common.loadgen import wait_ready
from bench.common.procs import free_port, spawn
from bench.common.repo import DOCS_DIR, RESULTS_DIR, ROOT, source_revision
from bench.common.wrk import run_wrk, write_script
from bench.frontend import report as frontend_report
from bench.frontend.servers import (
    FLAG,
    MODEL_NAME,
    TEXT,
    Server,
    build_model,
    check_answer,
    plan_servers,
)

try:
    import psutil
except ImportError:  # not a project dependency: the bench alone needs it
    sys.exit("python -m bench frontend needs psutil: pip install psutil")

logger = logging.getLogger(__name__)

WARMUP_CONCURRENCY = 16
READY_TIMEOUT_S = 180.0  # a tiny model: minutes mean a server that will not start
RSS_SAMPLE_S = 0.5
# A server that fails as procs.SERVER_FAILURES says, or whose process tree vanishes mid-point.
SERVER_FAILURES = (*procs.SERVER_FAILURES, psutil.Error)


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    name: str
    concurrencies: tuple[int, ...]
    point_s: int
    warmup_s: int
    rounds: int


MODES = {
    "quick": Mode("quick", (1, 64), 3, 2, 1),
    "full": Mode("full", (1, 16, 64, 256), 10, 5, 2),
}


def tree(pid: int) -> list[psutil.Process]:
    """The server's root process and every descendant alive now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_cpu_s(pid: int) -> float:
    """User + system seconds of the tree; children_* keeps the time of descendants that exited."""
    total = 0.0
    for proc in tree(pid):
        with contextlib.suppress(psutil.Error):  # a process that ended since the listing
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def tree_rss_mib(pid: int) -> float:
    """Resident memory of the tree (pages shared between its processes counted in each)."""
    total = 0
    for proc in tree(pid):
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 2**20


@contextlib.contextmanager
def rss_peak(pid: int) -> Iterator[list[float]]:
    """Sample the tree's RSS in a thread; the list's one value is the peak so far."""
    peak = [tree_rss_mib(pid)]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(RSS_SAMPLE_S):
            with contextlib.suppress(psutil.Error):
                peak[0] = max(peak[0], tree_rss_mib(pid))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def measure(
    server: Server, pid: int, url: str, script: Path, conc: int, mode: Mode
) -> dict[str, Any]:
    """One timed point: wrk's numbers and the tree's CPU time over it."""
    cpu_before, busy_before = tree_cpu_s(pid), _machine_busy_s()
    result, text = run_wrk(url, script, conc, mode.point_s)
    cpu = tree_cpu_s(pid) - cpu_before
    logger.info(
        "%s c=%d: %.0f req/s, p50 %.2f ms, p99 %.2f ms, %.2f CPU ms/req, %d errors",
        server.name,
        conc,
        result.requests_per_s,
        result.p50_ms,
        result.p99_ms,
        1e3 * cpu / max(result.requests, 1),
        result.errors,
    )
    return {
        "server": server.name,
        "concurrency": conc,
        **asdict(result),
        "errors": result.errors,
        "cpu_s": cpu,
        "cpu_ms_per_request": 1e3 * cpu / max(result.requests, 1),
        # Every core's busy time over the point: the server, wrk, and whatever else ran.
        "machine_busy_s": _machine_busy_s() - busy_before,
        "load_average": os.getloadavg(),
        "wrk_output": text,
    }


def _machine_busy_s() -> float:
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def run_server(
    server: Server, mode: Mode, script: Path, log_dir: Path
) -> tuple[list[dict[str, Any]], float]:
    """Start one server, warm it up untimed, measure every point; (points, peak tree RSS)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with spawn(server.launch(port), log_dir / f"{server.name}.log") as process:
        ready = wait_ready(base, server.ready_path, READY_TIMEOUT_S, lambda: process.poll() is None)
        asyncio.run(ready)
        url = base + server.embed_path
        check_answer(url)
        with rss_peak(process.pid) as peak:
            run_wrk(url, script, WARMUP_CONCURRENCY, mode.warmup_s)
            points = [
                measure(server, process.pid, url, script, c, mode) for c in mode.concurrencies
            ]
        return points, peak[0]


def _shown(command: list[str], model_dir: Path) -> str:
    """A command line as the report shows it: no temporary folder, no port, relative paths."""
    line = " ".join(command).replace(str(model_dir), "DIR").replace(f"{ROOT}/", "")
    return line.replace("--port 0", "--port PORT")


def run(mode: Mode, names: list[str]) -> dict[str, Any]:
    """Every round, every server in turn (reversed on odd rounds); the report as a dict."""
    points: list[dict[str, Any]] = []
    peaks: dict[str, float] = {}
    failures: list[str] = []
    source = source_revision()  # before the run: others may edit the tree while it goes on
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log_dir = RESULTS_DIR / f"frontend_logs_{mode.name}"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp:
        model_dir = build_model(Path(tmp) / "model")
        body = orjson.dumps({"input": TEXT, "model": MODEL_NAME}).decode()
        script = write_script(Path(tmp) / "post.lua", body)
        servers, not_run = plan_servers(model_dir, names)
        for round_ in range(mode.rounds):
            for server in servers if round_ % 2 == 0 else servers[::-1]:
                logger.info("round %d: %s", round_ + 1, server.name)
                try:
                    got, peak = run_server(server, mode, script, log_dir)
                except SERVER_FAILURES as exc:  # one server that fails must not hide the others
                    tail = (log_dir / f"{server.name}.log").read_text(errors="replace")[-2000:]
                    logger.error("%s failed: %s\n%s", server.name, exc, tail)
                    failures.append(f"{server.name} (round {round_ + 1}): {exc}")
                    continue
                points += [{**p, "round": round_ + 1} for p in got]
                peaks[server.name] = max(peaks.get(server.name, 0.0), peak)
        commands = {s.name: _shown(s.launch(0), model_dir) for s in servers}
    return {
        "mode": asdict(mode),
        "date": f"{started} to {time.strftime('%H:%M UTC', time.gmtime())}",
        "cpus": os.cpu_count(),
        "source": source,
        "text": TEXT,
        "commands": commands,
        "not_run": not_run,
        "failures": failures,
        "peak_rss_mib": peaks,
        "points": points,
    }


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the tables, write the JSON, the markdown and the plot."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="3 s points at concurrency 1 and 64")
    parser.add_argument(
        "--servers",
        default="poolserve,poolserve-2fe,infinity,floor",
        help="comma-separated subset of: poolserve,poolserve-2fe,poolserve-inproc (opt-in: "
        f"{FLAG} 0, the engine in a thread of the one process),infinity,floor",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk")
    mode = MODES["quick" if args.quick else "full"]
    report = run(mode, args.servers.split(","))
    out = RESULTS_DIR / f"frontend_{mode.name}.json"
    out.write_text(json.dumps(report, indent=1))
    text = frontend_report.markdown(report)
    (RESULTS_DIR / f"frontend_{mode.name}.md").write_text(text + "\n")
    print(text)
    plot = DOCS_DIR / "bench_frontend.png" if mode.name == "full" else out.with_suffix(".png")
    frontend_report.plot(report, plot)
    logger.info("wrote %s, %s", out, plot)


if __name__ == "__main__":
    main()
