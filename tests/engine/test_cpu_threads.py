"""CPU forwards get one thread per FLOPS_PER_THREAD of work: small steps run on one thread."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import poolserve.engine.cpu_threads as cpu_threads
from poolserve.engine.cpu_threads import StepThreads, matmul_flops_per_token
from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

CPU = torch.device("cpu")
EMBED = PoolingParams(task=PoolingTask.EMBED)
LAYER = re.compile(r"(^|\.)layers?\.\d+\.")  # BERT's encoder.layer.0., Llama's layers.0.


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (1, 1),
        (127, 1),  # below one thread's share
        (255, 1),
        (256, 2),  # two shares
        (383, 2),
        (384, 3),
        (10_000, 4),  # never above the process's count
    ],
)
def test_a_step_gets_one_thread_per_share_of_its_work(num_tokens: int, expected: int) -> None:
    # one thread's share of work is 128 tokens
    threads = StepThreads(flops_per_token=int(cpu_threads.FLOPS_PER_THREAD // 128), max_threads=4)
    assert threads.threads_for(num_tokens) == expected


def test_a_process_with_one_thread_never_asks_for_more() -> None:
    threads = StepThreads(flops_per_token=10**12, max_threads=1)
    assert threads.threads_for(1) == threads.threads_for(10**6) == 1
    assert StepThreads(flops_per_token=1, max_threads=0).threads_for(10**9) == 1


def _hf_layer_matmul_flops(model: torch.nn.Module) -> int:
    """2 x the weights of every nn.Linear inside transformers' own layer stack."""
    return 2 * sum(
        module.weight.numel()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and LAYER.search(name)
    )


@pytest.mark.parametrize("name", ["minilm", "llama", "qwen3"])
def test_the_work_per_token_counts_the_layers_matrices_as_transformers_builds_them(
    name: str, minilm_dir: Path, tiny_model_dir: Callable[[str], Path]
) -> None:
    directory = minilm_dir if name == "minilm" else tiny_model_dir(name)
    reference = transformers.AutoModel.from_pretrained(directory)
    loaded = load_model(str(directory), device=CPU)
    expected = _hf_layer_matmul_flops(reference)
    assert expected > 0
    assert matmul_flops_per_token(loaded.model) == expected


def _forward_threads(loaded: LoadedModel) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """The torch thread count each forward ran with, recorded on the forward's own thread."""
    seen: list[int] = []
    handle = loaded.model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_num_threads())
    )
    return seen, handle


async def _embed(loaded: LoadedModel, prompts: list[list[int]]) -> list[np.ndarray]:
    engine = Engine(loaded, SchedulerConfig(max_num_batched_tokens=4096), CPU)
    engine.start()
    try:
        outputs = await asyncio.gather(*engine.submit_many(prompts, EMBED))
    finally:
        await engine.stop()
    return [output.data for output in outputs]


def test_small_steps_run_on_one_thread_and_large_ones_on_all_with_the_same_outputs(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    max_threads = torch.get_num_threads()
    if max_threads < 2:
        pytest.skip("needs a process with at least two torch threads")
    loaded = load_model(str(tiny_model_dir("bert")), device=CPU)
    prompts = [[101, *range(2000 + i, 2010 + i), 102] for i in range(8)]
    seen, handle = _forward_threads(loaded)
    try:
        small = asyncio.run(_embed(loaded, prompts))
        assert seen == [1]  # a tiny model's step is far below one thread's share
        seen.clear()
        # the same step counted as heavy work: every thread the process has
        monkeypatch.setattr(cpu_threads, "FLOPS_PER_THREAD", 1.0)
        large = asyncio.run(_embed(loaded, prompts))
        assert seen == [max_threads]
    finally:
        handle.remove()
    for one, many in zip(small, large, strict=True):
        np.testing.assert_allclose(one, many, rtol=1e-5, atol=1e-6)
