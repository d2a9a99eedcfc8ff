"""The engine on CUDA: copy stream D2H, pinned buffers, async scheduling, bf16 vs fp32 CPU."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from models.loader import load_model
from pooling.params import PoolingParams, PoolingTask
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.request import PoolingOutput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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
    for g, w in zip(got, want, strict=True):
        a = g.data.reshape(-1, g.data.shape[-1]).astype(np.float64)
        b = w.data.reshape(-1, w.data.shape[-1]).astype(np.float64)
        cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
        assert cosine.min() >= 0.999
    assert cuda.blocks.num_used == 0
