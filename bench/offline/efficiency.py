"""Model FLOPs of a decoder forward and the machine's measured matmul FLOP/s on the model's shapes.

FLOP formula (stated in docs/benchmarks.md): per prompt of L tokens and per layer,
2 * (linear parameters of the layer) * L for the projections (q, k, v, o, gate, up, down) plus
4 * L * L * d / 2 for causal attention (QK^T and PV, 2 FLOPs per multiply-add, d = heads *
head_dim, half of the L x L pairs under the causal mask). Bidirectional encoders count the full
L x L. Embedding lookups, norms, activations and pooling are not counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs from a transformer config."""

    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    gated_mlp: bool

    @property
    def attention_width(self) -> int:
        """d = num_heads * head_dim (2048 for Qwen3-0.6B, wider than its hidden size 1024)."""
        return self.num_heads * self.head_dim

    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of each projection of one layer, q/k/v and gate/up fused."""
        kv = self.num_kv_heads * self.head_dim
        mlp_out = 2 * self.intermediate if self.gated_mlp else self.intermediate
        return (
            (self.hidden, self.attention_width + 2 * kv),  # qkv
            (self.attention_width, self.hidden),  # o
            (self.hidden, mlp_out),  # gate+up (or up)
            (self.intermediate, self.hidden),  # down
        )

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of the projections of one layer (biases ignored)."""
        return sum(i * o for i, o in self.linear_shapes())


def shape_from_config(config: PretrainedConfig) -> Shape:
    """Shape of a transformers config (decoder configs carry head_dim; BERT does not)."""
    heads = int(config.num_attention_heads)
    hidden = int(config.hidden_size)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    decoder = hasattr(config, "num_key_value_heads")
    return Shape(
        num_layers=int(config.num_hidden_layers),
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", heads)),
        head_dim=int(head_dim),
        causal=decoder,
        gated_mlp=decoder,
    )


def prompt_flops(shape: Shape, num_tokens: int) -> float:
    """Model FLOPs of one whole prompt (chunking does not change the total)."""
    linear = 2.0 * shape.linear_params_per_layer * num_tokens
    pairs = num_tokens * num_tokens / (2.0 if shape.causal else 1.0)
    attention = 4.0 * pairs * shape.attention_width
    return shape.num_layers * (linear + attention)


def workload_flops(shape: Shape, lengths: list[int]) -> float:
    """Model FLOPs of every prompt."""
    return sum(prompt_flops(shape, n) for n in lengths)


@dataclass(frozen=True)
class MatmulPeak:
    """Best measured FLOP/s of one layer's projections as plain matmuls."""

    flops_per_s: float
    num_tokens: int
    dtype: str
    seconds_per_layer: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_peak(
    shape: Shape,
    num_tokens: int = 2048,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    repeats: int = 10,
) -> MatmulPeak:
    """torch.mm over the layer's (in, out) shapes at num_tokens rows; best of repeats."""
    device = device or torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    pairs = [
        (
            torch.randn(num_tokens, i, generator=gen, device=device, dtype=dtype),  # [T, in]
            torch.randn(i, o, generator=gen, device=device, dtype=dtype),
        )  # [in, out]
        for i, o in shape.linear_shapes()
    ]
    flops = sum(2.0 * num_tokens * i * o for i, o in shape.linear_shapes())
    for x, w in pairs:  # warm-up: thread pool, allocator, kernel selection
        torch.mm(x, w)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for x, w in pairs:
            torch.mm(x, w)  # [T, out]
        _sync(device)
        best = min(best, time.perf_counter() - start)
    peak = MatmulPeak(flops / best, num_tokens, str(dtype).removeprefix("torch."), best)
    logger.info(
        "matmul peak %.1f GFLOP/s (%s, %d tokens)", peak.flops_per_s / 1e9, peak.dtype, num_tokens
    )
    return peak


def profile_engine_steps(
    model_dir: str, prompts: list[list[int]], num_steps: int, budget: int = 2048
) -> str:
    """torch.profiler table of the first steps' forwards, run in this thread (loop not started)."""
    import asyncio

    from poolserve.engine.loop import Engine
    from poolserve.models.loader import load_model
    from poolserve.types.limits import SchedulerConfig
    from poolserve.types.params import PoolingParams
    from poolserve.types.tasks import PoolingTask

    cpu = torch.device("cpu")
    loaded = load_model(model_dir, device=cpu, dtype=torch.float32)

    async def steps() -> str:
        engine = Engine(loaded, SchedulerConfig(max_num_batched_tokens=budget), cpu)
        engine.submit_many(prompts, PoolingParams(task=PoolingTask.EMBED))
        prepared = [engine._plan_and_prepare() for _ in range(num_steps)]
        engine.runner.execute(prepared[0])  # type: ignore[arg-type]  # warm-up
        acts = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            for step in prepared[1:]:
                if step is not None:
                    engine.runner.execute(step)
        await engine.stop()
        return str(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))

    return asyncio.run(steps())
