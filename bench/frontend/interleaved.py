"""Front-end servers side by side: all of them up at once, wrk taking turns among them.

Run from the repository root:
`python -m bench frontend-interleaved [--servers poolserve,poolserve-2fe,floor] [--base REV]
[--concurrency 64] [--rounds 10] [--point-s 3]`.

Why: on a shared machine whose speed drifts by tens of percent within minutes, a server measured
minutes after another meets a different machine, and `bench frontend`'s sequential points differ
by more than most changes do. Here every round gives each server one short point in turn (the
order reversed every other round), so a drift lands on all of them alike. Each server's totals
over the rounds give its req/s and its CPU per request (the whole process tree, as `bench
frontend` counts it), and its ratio to the floor's req/s in the same rounds. The idle servers
wait on their sockets meanwhile.

`--base REV` adds `poolserve-2fe@REV`: the two-front-end server of a git revision (`git archive`
into a temporary folder, first on PYTHONPATH), so a change and its base are measured together.
Same workload and model as `bench frontend` (one 14-word text per request, the near-free BERT).
Writes bench/results/frontend_interleaved.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from bench.common.loadgen import wait_ready
from bench.common.procs import free_port, spawn
from bench.common.repo import RESULTS_DIR, ROOT, source_revision
from bench.common.wrk import run_wrk, write_script
from bench.frontend.sequential import READY_TIMEOUT_S, tree_cpu_s
from bench.frontend.servers import (
    MODEL_NAME,
    TEXT,
    Server,
    build_model,
    check_answer,
    plan_servers,
)

logger = logging.getLogger(__name__)

FLOOR = "floor"
WARMUP_S = 3


@dataclass(frozen=True)
class Running:
    """A started server: its name, root process and embeddings URL."""

    name: str
    pid: int
    url: str


@dataclass(frozen=True)
class Total:
    """One server's sums over every round."""

    name: str
    requests: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0
    errors: int = 0

    def add(self, requests: int, seconds: float, cpu_s: float, errors: int) -> Total:
        """These sums with one more point."""
        return replace(
            self,
            requests=self.requests + requests,
            seconds=self.seconds + seconds,
            cpu_s=self.cpu_s + cpu_s,
            errors=self.errors + errors,
        )


def summary(totals: list[Total]) -> list[dict[str, Any]]:
    """Each server's req/s, CPU ms per request and req/s over the floor's (None: no floor)."""
    rates = {t.name: t.requests / t.seconds if t.seconds else 0.0 for t in totals}
    floor = rates.get(FLOOR)
    return [
        {
            "server": t.name,
            "requests": t.requests,
            "requests_per_s": rates[t.name],
            "cpu_ms_per_request": 1e3 * t.cpu_s / t.requests if t.requests else None,
            "of_floor": rates[t.name] / floor if floor else None,
            "errors": t.errors,
        }
        for t in totals
    ]


def markdown(report: dict[str, Any]) -> str:
    """The report as the table docs/benchmarks.md quotes."""
    lines = [
        f"Interleaved front-end run, {report['date']}, {report['source']}: concurrency "
        f"{report['concurrency']}, {report['rounds']} rounds of {report['point_s']} s per server.",
        "",
        "| server | req/s | CPU ms/request | of the floor | errors |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in report["summary"]:
        cpu = row["cpu_ms_per_request"]
        share = row["of_floor"]
        lines.append(
            f"| {row['server']} | {row['requests_per_s']:,.0f} | "
            f"{'-' if cpu is None else f'{cpu:.3f}'} | "
            f"{'-' if share is None else f'{share:.2f}x'} | {row['errors']} |"
        )
    lines += [f"- not run: {name}: {why}" for name, why in report["not_run"].items()]
    return "\n".join(lines)


def revision_tree(revision: str, into: Path) -> Path:
    """The revision's files (`git archive`), for a server to run from."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", revision], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def at_revision(server: Server, revision: str, tree: Path) -> Server:
    """The same server started from another revision's files."""

    def launch(port: int) -> list[str]:
        # its folder as the working directory too: `python -m` puts that first on sys.path
        return ["env", "-C", str(tree), f"PYTHONPATH={tree}", *server.launch(port)]

    return replace(server, name=f"{server.name}@{revision}", launch=launch)


def take_turns(running: list[Running], script: Path, args: argparse.Namespace) -> list[Total]:
    """Every round, one point per server; the order reversed every other round."""
    totals = {r.name: Total(r.name) for r in running}
    for round_ in range(args.rounds):
        for server in running if round_ % 2 == 0 else running[::-1]:
            before = tree_cpu_s(server.pid)
            result, _ = run_wrk(server.url, script, args.concurrency, args.point_s)
            cpu = tree_cpu_s(server.pid) - before
            totals[server.name] = totals[server.name].add(
                result.requests, result.duration_s, cpu, result.errors
            )
        logger.info("round %d of %d done", round_ + 1, args.rounds)
    return [totals[r.name] for r in running]


def start(server: Server, stack: contextlib.ExitStack, log_dir: Path) -> Running:
    """Start a server (stopped when the stack closes) and check one answer."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    process = stack.enter_context(spawn(server.launch(port), log_dir / f"{server.name}.log"))
    ready = wait_ready(base, server.ready_path, READY_TIMEOUT_S, lambda: process.poll() is None)
    asyncio.run(ready)
    check_answer(base + server.embed_path)
    return Running(server.name, process.pid, base + server.embed_path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start every server, warm each, take turns; the report as a dict."""
    source = source_revision()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    log_dir = RESULTS_DIR / "frontend_interleaved_logs"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-interleaved-"))
        model_dir = build_model(Path(tmp) / "model")
        body = orjson.dumps({"input": TEXT, "model": MODEL_NAME}).decode()
        script = write_script(Path(tmp) / "post.lua", body)
        servers, not_run = plan_servers(model_dir, args.servers.split(","))
        if args.base:
            two, _ = plan_servers(model_dir, ["poolserve-2fe"])
            if not two:
                sys.exit("--base needs poolserve-2fe (--api-server-count) in this checkout")
            tree = revision_tree(args.base, Path(tmp) / "base")
            servers.append(at_revision(two[0], args.base, tree))
        running = [start(server, stack, log_dir) for server in servers]
        for server in running:  # untimed: first connections, caches, the allocator
            run_wrk(server.url, script, args.concurrency, WARMUP_S)
        totals = take_turns(running, script, args)
    return {
        "date": f"{started} to {time.strftime('%H:%M UTC', time.gmtime())}",
        "source": source,
        "base": args.base,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "point_s": args.point_s,
        "text": TEXT,
        "not_run": not_run,
        "summary": summary(totals),
    }


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the table, write the JSON and the markdown."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--servers",
        default="poolserve,poolserve-2fe,floor",
        help="comma-separated, as for `bench frontend` (infinity too)",
    )
    parser.add_argument("--base", help="also run poolserve-2fe from this git revision")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--point-s", type=int, default=3, help="seconds of one server's turn")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk")
    report = run(args)
    out = RESULTS_DIR / "frontend_interleaved.json"
    out.write_text(json.dumps(report, indent=1))
    text = markdown(report)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
