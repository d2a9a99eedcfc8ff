"""One entry point: `python -m bench PART [--quick]`.

PART is offline, served, token, rerank, engine, planner, prefix, soak or all. Each part is
imported only when it runs (the served part and the engine parts load heavy dependencies), and
receives the remaining arguments. `all` runs every peer benchmark in turn with the same flags
(only `--quick` is passed on to all of them); the soak run is separate, since it needs a quiet
machine for minutes. So are `fleet` (replicas behind HAProxy), `fleet-ray` (Ray Serve),
`precision` (fidelity and speed of each --dtype and --quantization, not a peer comparison),
`cpu-peers` (poolserve's CPU precisions against ONNX Runtime, OpenVINO, sentence-transformers) and
`frontend` (per-request cost of the HTTP front ends on a near-free model, driven by wrk) with
`frontend-interleaved` (the same servers up at once, taking turns, for same-moment ratios), and
`footprint` (the command line's answer times, every server process's memory, the modules one
request runs), `static` (a model2vec model through the offline engine against model2vec's
own encode), `lora` (LoRA adapters mixed in one step against the base model alone), `images`
(a CLIP checkpoint's images through the engine against transformers), `vision-language` (Qwen2-VL
prompts with images through the engine against transformers) and `api-keys` (what API
keys cost a request at the edge). So is `grpc`
(TEI's gRPC EmbedStream against HTTP /embed on one server, same batch sizes), `batch`
(interactive latency with and without a running Batch API batch), and so is
`images-served` (poolserve against Infinity on one CLIP checkpoint: images, and images mixed
with texts; it starts both servers and needs Infinity's environment).
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
    """Run a part whose main() reads sys.argv itself (module: its path under bench)."""
    saved = sys.argv
    sys.argv = [f"bench.{module}", *argv]
    try:
        importlib.import_module(f"bench.{module}").main()
    finally:
        sys.argv = saved


def _with_list(module: str, argv: Sequence[str]) -> None:
    """Run a part whose main(argv) takes its arguments (module: its path under bench)."""
    importlib.import_module(f"bench.{module}").main(list(argv))


def _planner(argv: Sequence[str]) -> None:
    """The planner micro-benchmark has no flags; --quick changes nothing there."""
    importlib.import_module("bench.engine.planner").main()


PARTS: dict[str, Callable[[Sequence[str]], None]] = {
    "offline": lambda argv: _with_list("offline.cpu", argv),
    "served": lambda argv: _with_list("served.embeddings", argv),
    "token": lambda argv: _with_list("served.token_level", argv),
    "rerank": lambda argv: _with_list("served.rerank", argv),
    "engine": lambda argv: _with_argv("engine.loop", argv),
    "planner": _planner,
    "prefix": lambda argv: _with_argv("engine.prefix_cache", argv),
}
# Not part of `all`: a stability run of many minutes, fleet runs (HAProxy, Ray), the precision
# run (not comparisons with peers), and the front-end run (wrk, several server starts).
SEPARATE: dict[str, Callable[[Sequence[str]], None]] = {
    "soak": lambda argv: _with_list("soak.saturation", argv),
    "fleet": lambda argv: _with_list("fleet.haproxy", argv),
    "fleet-ray": lambda argv: _with_list("fleet.ray_serve", argv),
    "ray-embed": lambda argv: _with_list("jobs.ray_data", argv),
    "precision": lambda argv: _with_list("precision.fidelity", argv),
    "cpu-peers": lambda argv: _with_list("precision.cpu_peers", argv),
    "frontend": lambda argv: _with_list("frontend.sequential", argv),
    "frontend-interleaved": lambda argv: _with_list("frontend.interleaved", argv),
    "footprint": lambda argv: _with_list("frontend.footprint", argv),
    "api-keys": lambda argv: _with_list("frontend.api_keys", argv),
    "models": lambda argv: _with_list("served.models", argv),
    "embed-job": lambda argv: _with_list("jobs.embed", argv),
    "step-threads": lambda argv: _with_list("engine.step_threads", argv),
    "static": lambda argv: _with_list("offline.static", argv),
    "lora": lambda argv: _with_list("offline.lora", argv),
    "images": lambda argv: _with_list("offline.images", argv),
    "vision-language": lambda argv: _with_list("offline.vision_language", argv),
    "images-served": lambda argv: _with_list("served.images", argv),
    "grpc": lambda argv: _with_list("served.grpc", argv),
    "batch": lambda argv: _with_list("served.batch", argv),
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
