"""Ray Serve, live: replicas of deploy/ray/poolserve_app.py behind Serve's proxy, one killed.

`python -m bench fleet-ray` (needs the `ray` extra) starts a local Ray cluster, runs the Serve
application with `--replicas` replicas of the default model on CPU, drives a closed-loop load
through Serve's HTTP proxy, reads each replica's own poolserve_requests_total from /metrics (the
x-poolserve-replica header says which replica answered), kills one replica under load, waits for
Serve to replace it, and reports every failed request with its reason and time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common.procs import free_port, wait_for
from bench.common.repo import ROOT
from bench.fleet.load import ClosedLoop

logger = logging.getLogger(__name__)

APP_DIR = ROOT / "deploy" / "ray"
APP_NAME = "poolserve"
DEPLOYMENT = "PoolserveReplica"
ROUTE = "/v1/embeddings"


def replica_counts(url: str, expected: int, tries: int = 200) -> dict[str, int]:
    """Each replica's own count of 200s on ROUTE, read from its /metrics through the proxy."""
    counts: dict[str, int] = {}
    for _ in range(tries):
        response = httpx.get(url + "/metrics", timeout=10.0)
        replica = response.headers.get("x-poolserve-replica")
        if response.status_code == 200 and replica is not None:
            counts[replica] = _served(response.text)
        if len(counts) >= expected:
            break
    return counts


def _served(text: str) -> int:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "poolserve_requests_total"
                and labels.get("endpoint") == ROUTE
                and labels.get("status") == "200"
            ):
                total += sample.value
    return int(total)


def _replaced(url: str, victim: str, expected: int) -> bool:
    """Serve runs `expected` replicas again, and all of them answer, none being the victim."""
    if running_replicas() != expected:
        return False
    answering = replica_counts(url, expected, tries=20)
    return len(answering) == expected and victim not in answering


def running_replicas() -> int:
    """Replicas Serve reports RUNNING."""
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments[DEPLOYMENT]
    return sum(n for state, n in status.replica_states.items() if state == "RUNNING")


def run(args: argparse.Namespace) -> dict[str, object]:
    """Start, load, count, kill, count again; the report."""
    import ray
    from ray import serve

    sys.path.insert(0, str(APP_DIR))
    import poolserve_app  # deploy/ray/poolserve_app.py

    pythonpath = f"{ROOT}:{APP_DIR}"
    ray.init(
        num_cpus=args.cpus,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    serve.run(
        poolserve_app.build(
            {
                "num_replicas": str(args.replicas),
                "gpus_per_replica": "0",
                "cpus_per_replica": "1",
                "server": args.server,
            }
        ),
        name=APP_NAME,
        route_prefix="/",
    )
    logger.info("%d replicas running after %.0f s", args.replicas, time.monotonic() - started)
    load = ClosedLoop(url + ROUTE, args.concurrency).start()
    time.sleep(args.phase_s)
    before = replica_counts(url, args.replicas)
    victim = sorted(before)[0]
    killed_at = load.now()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    logger.info("killed %s at %.1f s", victim, killed_at)
    wait_for(lambda: _replaced(url, victim, args.replicas), 300.0, "Serve to replace the replica")
    replaced_at = load.now()
    time.sleep(args.phase_s)
    after = replica_counts(url, args.replicas)
    summary = load.stop()
    failed = [o for o in load.outcomes if not o.ok]
    serve.shutdown()
    ray.shutdown()
    return {
        "replicas": args.replicas,
        "concurrency": args.concurrency,
        "sent": summary.sent,
        "num_failed": summary.failed,
        "failures": summary.failures,
        "failed": [
            {
                "started_s": round(o.started_s, 2),
                "latency_s": round(o.latency_s, 2),
                "error": o.error,
                "detail": o.detail,
            }
            for o in failed
        ],
        "killed": victim,
        "killed_at_s": round(killed_at, 2),
        "replaced_at_s": round(replaced_at, 2),
        "served_200_before_kill": before,
        "served_200_at_end": after,
        "tokens_per_s": round(summary.tokens_per_s),
        "p99_ms": round(summary.p99_ms),
    }


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the report as JSON (and write it to --out)."""
    parser = argparse.ArgumentParser(prog="python -m bench fleet-ray", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--phase-s",
        type=float,
        default=20.0,
        help="load before the kill, and again after the replacement",
    )
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs of the Ray cluster")
    parser.add_argument(
        "--server",
        default="--max-num-batched-tokens 1024 --log-level warning",
        help="poolserve flags of each replica",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
