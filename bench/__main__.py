"""One entry point: `python -m bench PART [--quick]`.

PART is offline, served, token, rerank, engine, planner, prefix, soak or all. Each part is
imported only when it runs (the served part and the engine parts load heavy dependencies), and
receives the remaining arguments. `all` runs every peer benchmark in turn with the same flags
(only `--quick` is passed on to all of them); the soak run is separate, since it needs a quiet
machine for minutes. So are `fleet` (replicas behind HAProxy), `fleet-ray` (Ray Serve),
`precision` (fidelity and speed of each --dtype and --quantization, not a peer comparison),
`cpu-peers` (poolserve's CPU precisions against ONNX Runtime, OpenVINO, sentence-transformers) and
`frontend` (per-request cost of the HTTP front ends on a near-free model, driven by wrk) with
`frontend-interleaved` (the same servers up at once, taking turns, for same-moment ratios).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from poolserve.models.cpu_class import cpu_class

logger = logging.getLogger(__name__)


def _with_argv(module: str, argv: Sequence[str]) -> None:
    """Run a part whose main() reads sys.argv itself."""
    saved = sys.argv
    sys.argv = [f"bench.{module}", *argv]
    try:
        importlib.import_module(f"bench.{module}").main()
    finally:
        sys.argv = saved


def _with_list(module: str, argv: Sequence[str]) -> None:
    """Run a part whose main(argv) takes its arguments."""
    importlib.import_module(f"bench.{module}").main(list(argv))


def _planner(argv: Sequence[str]) -> None:
    """The planner micro-benchmark has no flags; --quick changes nothing there."""
    importlib.import_module("bench.planner_bench").main()


PARTS: dict[str, Callable[[Sequence[str]], None]] = {
    "offline": lambda argv: _with_list("offline", argv),
    "served": lambda argv: _with_list("served", argv),
    "token": lambda argv: _with_list("token_level", argv),
    "rerank": lambda argv: _with_list("rerank", argv),
    "engine": lambda argv: _with_argv("engine_bench", argv),
    "planner": _planner,
    "prefix": lambda argv: _with_argv("prefix_bench", argv),
}
# Not part of `all`: a stability run of many minutes, fleet runs (HAProxy, Ray), the precision
# run (not comparisons with peers), and the front-end run (wrk, several server starts).
SEPARATE: dict[str, Callable[[Sequence[str]], None]] = {
    "soak": lambda argv: _with_list("soak", argv),
    "fleet": lambda argv: _with_list("fleet", argv),
    "fleet-ray": lambda argv: _with_list("fleet_ray", argv),
    "ray-embed": lambda argv: _with_list("ray_embed", argv),
    "precision": lambda argv: _with_list("precision", argv),
    "cpu-peers": lambda argv: _with_list("cpu_peers", argv),
    "frontend": lambda argv: _with_list("frontend", argv),
    "frontend-interleaved": lambda argv: _with_list("frontend_interleaved", argv),
    "models": lambda argv: _with_list("models", argv),
    "embed-job": lambda argv: _with_list("embed_job", argv),
    "step-threads": lambda argv: _with_list("step_threads", argv),
}


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch to one part, or every part in turn."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("part", choices=[*PARTS, *SEPARATE, "all"])
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_args(argv[:1]), argv[1:]  # the part's own flags, --help too
    # every result depends on the CPU class: each report says which it was taken on
    print(f"CPU class: {cpu_class()}", flush=True)
    if args.part != "all":
        {**PARTS, **SEPARATE}[args.part](rest)
        return
    shared = ["--quick"] if "--quick" in rest else []
    failed = []
    for name, part in PARTS.items():
        logger.warning("bench part %s", name)
        try:
            part(shared)
        except Exception:  # one broken part must not hide the others' results
            logger.exception("bench part %s failed", name)
            failed.append(name)
    if failed:
        sys.exit(f"failed parts: {', '.join(failed)}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    main()
