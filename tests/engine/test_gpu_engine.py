"""The engine on CUDA: copy stream D2H, pinned buffers, async scheduling, bf16 vs fp32 CPU."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.models.test_gpu import bf16_bound, hf_bf16_hidden, relative_errors
from tests.tiny_models import build_hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
logger = logging.getLogger(__name__)


async def _run(engine: Engine, prompts: list[list[int]], task: PoolingTask) -> list[PoolingOutput]:
    engine.start()
    try:
        futures = engine.submit_many(prompts, PoolingParams(task=task, normalize=False))
        return list(await asyncio.gather(*futures))
    finally:
        await engine.stop()


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("task", [PoolingTask.EMBED, PoolingTask.TOKEN_EMBED])
def test_cuda_engine_matches_cpu(
    tiny_model_dir: Callable[[str], Path], async_scheduling: bool, task: PoolingTask
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 30000) for _ in range(rng.randint(1, 300))] for _ in range(40)]
    path = str(tiny_model_dir("qwen3"))
    config = SchedulerConfig(
        max_num_batched_tokens=128,
        block_size=16,
        num_kv_blocks=512,
        async_scheduling=async_scheduling,
    )
    cuda = Engine(load_model(path, device=torch.device("cuda")), config, torch.device("cuda"))
    cpu = Engine(load_model(path, device=torch.device("cpu")), config, torch.device("cpu"))
    got = asyncio.run(_run(cuda, prompts, task))
    want = asyncio.run(_run(cpu, prompts, task))
    # Pooled rows (last token or mean) err no more than the worst token: one bound serves both.
    bound = bf16_bound(hf_bf16_hidden("qwen3", prompts), _hf_float32_hidden(prompts))
    error = max(
        relative_errors(_rows(g.data), _rows(w.data)).max().item()
        for g, w in zip(got, want, strict=True)
    )
    logger.info("%s async=%s: error %.3g, bound %.3g", task, async_scheduling, error, bound)
    assert error <= bound, (error, bound)
    assert cuda.blocks.num_used == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_cuda_prefix_caching_matches_cpu(
    tiny_model_dir: Callable[[str], Path], async_scheduling: bool
) -> None:
    """Prompts sharing prefixes read cached KV pages on CUDA; the CPU runs them without a cache."""
    rng = random.Random(1)
    prefix = [rng.randrange(1, 30000) for _ in range(100)]
    prompts = [
        prefix[: rng.randint(1, 100)] + [rng.randrange(1, 30000) for _ in range(rng.randint(1, 60))]
        for _ in range(40)
    ]
    path = str(tiny_model_dir("qwen3"))
    config = SchedulerConfig(
        max_num_batched_tokens=128,
        block_size=16,
        num_kv_blocks=512,
        async_scheduling=async_scheduling,
    )
    cuda = Engine(load_model(path, device=torch.device("cuda")), config, torch.device("cuda"))
    cpu = Engine(
        load_model(path, device=torch.device("cpu")),
        dataclasses.replace(config, enable_prefix_caching=False),
        torch.device("cpu"),
    )

    async def waves() -> list[PoolingOutput]:
        params = PoolingParams(task=PoolingTask.EMBED, normalize=False)
        cuda.start()
        try:
            first = await asyncio.gather(*cuda.submit_many(prompts[:1], params))
            return [*first, *await asyncio.gather(*cuda.submit_many(prompts[1:], params))]
        finally:
            await cuda.stop()

    got = asyncio.run(waves())
    want = asyncio.run(_run(cpu, prompts, PoolingTask.EMBED))
    bound = bf16_bound(hf_bf16_hidden("qwen3", prompts), _hf_float32_hidden(prompts))
    error = max(
        relative_errors(_rows(g.data), _rows(w.data)).max().item()
        for g, w in zip(got, want, strict=True)
    )
    logger.info("prefix caching async=%s: error %.3g, bound %.3g", async_scheduling, error, bound)
    assert error <= bound, (error, bound)
    assert cuda.blocks.num_hit_tokens > 0 and cuda.blocks.num_used == 0


def _rows(data: np.ndarray) -> torch.Tensor:
    """An output as rows of the hidden size: [hidden] -> [1, hidden]; [L, hidden] stays."""
    return torch.from_numpy(data.reshape(-1, data.shape[-1]))


def _hf_float32_hidden(prompts: list[list[int]]) -> list[torch.Tensor]:
    """The transformers reference of the tiny qwen3 in float32 on the CPU."""
    backbone = build_hf_model("qwen3").base_model
    with torch.no_grad():
        return [backbone(input_ids=torch.tensor([p])).last_hidden_state[0] for p in prompts]
