"""Request timelines: the steps each request ran in, recorded only when asked for."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask

CPU = torch.device("cpu")
BUDGET = 64


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


async def _run(loaded: LoadedModel, record: bool, prompts: list[list[int]]) -> list[PoolingOutput]:
    config = SchedulerConfig(
        max_num_batched_tokens=BUDGET,
        block_size=8,
        num_kv_blocks=256,
        enable_prefix_caching=False,  # every prompt token is computed in some step
        record_timelines=record,
    )
    engine = Engine(loaded, config, CPU)
    engine.start()
    try:
        futures = engine.submit_many(prompts, PoolingParams(task=PoolingTask.EMBED))
        return list(await asyncio.gather(*futures))
    finally:
        await engine.stop()


def test_timelines_account_for_every_token_of_every_step(llama: LoadedModel) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 30000) for _ in range(n)] for n in (150, 20, 90, 5)]
    outputs = asyncio.run(_run(llama, True, prompts))
    per_step: dict[int, list[tuple[int, int, int]]] = {}
    for prompt, output in zip(prompts, outputs, strict=True):
        timeline = output.timeline
        assert timeline is not None
        steps = timeline.steps
        # chunked prefill: a prompt runs in at least ceil(len / budget) steps, in step order
        assert len(steps) >= math.ceil(len(prompt) / BUDGET)
        assert [s.step_index for s in steps] == sorted({s.step_index for s in steps})
        assert sum(s.num_tokens for s in steps) == len(prompt)
        assert timeline.arrival_time <= timeline.first_scheduled_time <= steps[0].started_at
        assert steps[-1].started_at + steps[-1].duration_s <= timeline.finished_time
        assert output.queue_time_s == pytest.approx(
            timeline.first_scheduled_time - timeline.arrival_time
        )
        for s in steps:
            per_step.setdefault(s.step_index, []).append(
                (s.num_tokens, s.num_step_tokens, s.num_step_seqs)
            )
    # these requests are all the engine ran: each step's chunks add up to its size
    for chunks in per_step.values():
        assert sum(c[0] for c in chunks) == chunks[0][1] <= BUDGET
        assert len(chunks) == chunks[0][2]
        assert len({(c[1], c[2]) for c in chunks}) == 1


def test_nothing_is_recorded_when_timelines_are_off(llama: LoadedModel) -> None:
    outputs = asyncio.run(_run(llama, False, [[5, 6, 7], [8] * 100]))
    assert [o.timeline for o in outputs] == [None, None]
