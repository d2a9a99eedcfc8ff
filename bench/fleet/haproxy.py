"""Replicas behind HAProxy under load: rolling-restart losses, and scaling 1 -> N.

`python -m bench fleet restart` restarts each of three replicas in turn (SIGTERM, wait for the
exit, start again, wait until HAProxy routes to it) under a closed-loop load, once per variant:
    retrying        the shipped config (request buffering, retries, redispatch), --drain-delay 3
    plain-nodelay   a balancer that cannot replay a POST, servers without --drain-delay
    plain-delay     the same balancer, servers with --drain-delay 3 (the server-side handshake)
and reports sent and failed requests with their reasons.

`python -m bench fleet scale` measures tokens/s and p99 with one replica, then starts the others,
waits until HAProxy routes to them, and measures again with the same load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

from bench.common.procs import wait_for
from bench.fleet.load import ClosedLoop, LoadSummary, summarize
from bench.fleet.replicas import READY_TIMEOUT_S, fleet, restart

logger = logging.getLogger(__name__)

BASE_ARGS = (
    "--max-num-batched-tokens",
    "1024",
    "--max-num-seqs",
    "64",
    "--shutdown-timeout",
    "20",
    "--log-level",
    "warning",
)
# variant -> (balancer replays requests, --drain-delay of the servers)
VARIANTS: dict[str, tuple[bool, float]] = {
    "retrying": (True, 3.0),
    "plain-nodelay": (False, 0.0),
    "plain-delay": (False, 3.0),
}


def restart_run(variant: str, workdir: Path, concurrency: int, rounds: int) -> dict[str, object]:
    """`rounds` rolling restarts of three replicas under load; what was lost and why."""
    retrying, delay = VARIANTS[variant]
    server_args = (*BASE_ARGS, "--drain-delay", str(delay))
    with fleet(workdir, 3, server_args, retrying=retrying) as (replicas, balancer):
        load = ClosedLoop(balancer.url + "/v1/embeddings", concurrency).start()
        try:
            codes = [restart(r, balancer) for _ in range(rounds) for r in replicas]
        finally:
            summary = load.stop()
        served = balancer.served()
    return {
        "variant": variant,
        "balancer_replays": retrying,
        "drain_delay_s": delay,
        "restarts": len(codes),
        "exit_codes": sorted(set(codes)),
        "served_2xx": served,
        **_fields(summary),
    }


def scale_run(workdir: Path, concurrency: int, replicas: int, phase_s: float) -> dict[str, object]:
    """The same load on 1 replica, then on `replicas`."""
    server_args = (*BASE_ARGS, "--drain-delay", "3")
    with fleet(workdir, replicas, server_args, num_started=1) as (procs, balancer):
        load = ClosedLoop(balancer.url + "/v1/embeddings", concurrency).start()
        time.sleep(phase_s)
        one = summarize(load.since(0.0), load.now())
        for replica in procs[1:]:
            replica.start()
        for replica in procs[1:]:
            wait_for(replica.is_ready, READY_TIMEOUT_S, f"{replica.name} ready")
            balancer.wait_status(replica.name, "UP")
        scaled_at = load.now()
        time.sleep(phase_s)
        many = summarize(load.since(scaled_at), load.now() - scaled_at)
        total = load.stop()
    return {
        "concurrency": concurrency,
        "one_replica": _fields(one),
        f"{replicas}_replicas": _fields(many),
        "failed_overall": total.failed,
        "scale_up_s": round(scaled_at - phase_s, 1),
    }


def _fields(summary: LoadSummary) -> dict[str, object]:
    fields = dataclasses.asdict(summary)
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in fields.items()}


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run the chosen measurement, print (and write) the report as JSON."""
    parser = argparse.ArgumentParser(
        prog="python -m bench fleet",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", choices=["restart", "scale"])
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="restart: comma-separated subset of " + ", ".join(VARIANTS),
    )
    parser.add_argument("--rounds", type=int, default=1, help="restart: rolling restarts per run")
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--replicas", type=int, default=3, help="scale: replicas after scaling")
    parser.add_argument("--phase-s", type=float, default=30.0, help="scale: seconds per phase")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    reports: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="poolserve-fleet-") as tmp:
        if args.mode == "scale":
            reports.append(scale_run(Path(tmp), args.concurrency, args.replicas, args.phase_s))
        for variant in args.variants.split(",") if args.mode == "restart" else ():
            workdir = Path(tmp) / variant
            workdir.mkdir()
            reports.append(restart_run(variant, workdir, args.concurrency, args.rounds))
            logger.info("%s", reports[-1])
    text = json.dumps(reports, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
