"""Token type ids end to end: submission checks, chunk slices, type buffers, BERT pairs == HF."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from poolserve.engine.loop import Engine
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import InvalidTokenTypeError
from poolserve.types.limits import SchedulerConfig
from poolserve.types.outputs import PoolingOutput
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.models.driver import assert_close

CPU = torch.device("cpu")
# Raw hidden states per token, so every token's type shows in the comparison.
HIDDEN = PoolingParams(task=PoolingTask.TOKEN_EMBED, normalize=False)
PAIRS = (
    ("what is the capital of france?", "paris is the capital and largest city of france."),
    ("how tall is mount everest", "mount everest rises 8,849 metres above sea level."),
)
SINGLES = ("a single text with no pair", "another one, somewhat longer than the first text")


def _config(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "max_num_batched_tokens": 512,
        "max_num_seqs": 16,
        "block_size": 16,
        "num_kv_blocks": 64,
        "enable_chunked_prefill": False,
    }
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bert_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    return tiny_model_dir("bert")


@pytest.fixture(scope="module")
def bert(bert_dir: Path) -> LoadedModel:
    return load_model(str(bert_dir), device=CPU)


@pytest.fixture(scope="module")
def hf_bert(bert_dir: Path) -> Any:
    return transformers.AutoModel.from_pretrained(str(bert_dir), attn_implementation="eager").eval()


def _hf_hidden(model: Any, ids: list[int], types: list[int] | None) -> torch.Tensor:
    """transformers' last hidden states of one prompt, with its type ids when given."""
    kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state[0]


async def _run(
    loaded: LoadedModel,
    config: SchedulerConfig,
    batches: list[tuple[list[list[int]], list[list[int] | None]]],
) -> list[PoolingOutput]:
    """Every batch submitted at once (so they share steps), outputs in submission order."""
    engine = Engine(loaded, config, CPU)
    engine.start()
    try:
        futures = [
            future
            for prompts, types in batches
            for future in engine.submit_many(prompts, HIDDEN, token_type_ids=types)
        ]
        return list(await asyncio.gather(*futures))
    finally:
        await engine.stop()


@pytest.fixture
def forward_calls(bert: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Records, per forward of the bert backbone, whether it was given token type ids."""
    calls: list[bool] = []
    original = bert.model.forward

    def recording(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs.get("token_type_ids") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(bert.model, "forward", recording)
    yield calls


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_pairs_packed_with_single_texts_equal_hf(
    bert: LoadedModel, hf_bert: Any, forward_calls: list[bool], async_scheduling: bool
) -> None:
    tokenizer = bert.tokenizer
    pairs = [tokenizer(q, d) for q, d in PAIRS]
    singles = [tokenizer(text) for text in SINGLES]
    assert all(any(p["token_type_ids"]) for p in pairs)
    # One batch mixes pairs, a single text without types and one with its all-zero types; the
    # single-text batches after it take steps of their own, with no types in them at all.
    mixed = (
        [pairs[0]["input_ids"], singles[0]["input_ids"], pairs[1]["input_ids"]],
        [pairs[0]["token_type_ids"], None, pairs[1]["token_type_ids"]],
    )
    plain: list[tuple[list[list[int]], list[list[int] | None]]] = [
        ([s["input_ids"]], [s["token_type_ids"]]) for s in singles
    ]
    # Three prompts a step: the mixed batch runs first, the single texts after it.
    config = _config(max_num_seqs=3, async_scheduling=async_scheduling)
    outputs = asyncio.run(_run(bert, config, [mixed, *plain]))
    wanted = [
        (pairs[0]["input_ids"], pairs[0]["token_type_ids"]),
        (singles[0]["input_ids"], None),
        (pairs[1]["input_ids"], pairs[1]["token_type_ids"]),
        *((s["input_ids"], None) for s in singles),
    ]
    for output, (ids, types) in zip(outputs, wanted, strict=True):
        assert_close(torch.from_numpy(output.data), _hf_hidden(hf_bert, ids, types))
    # The types reached the embeddings: without them a pair's second segment comes out different.
    untyped = _hf_hidden(hf_bert, pairs[0]["input_ids"], None)
    assert not torch.allclose(torch.from_numpy(outputs[0].data), untyped, atol=1e-3)
    # Steps with a pair got the type buffer; the steps of single texts got None.
    assert forward_calls == [True, False]


@pytest.mark.parametrize(
    ("types", "match"),
    [
        ([0, 1], "2 token type ids given for a prompt of 3 tokens"),
        ([0, 1, 2], r"token type id 2 is out of range \[0, 2\)"),
        ([0, -1, 1], r"token type id -1 is out of range"),
        ([0, 1, 2**70], "must be integers"),
    ],
)
def test_bad_types_are_refused_and_nothing_is_admitted(
    bert: LoadedModel, types: list[int], match: str
) -> None:
    async def submit() -> Engine:
        engine = Engine(bert, _config(), CPU)
        with pytest.raises(InvalidTokenTypeError, match=match):
            engine.submit_many([[101, 2000, 102], [101, 102]], HIDDEN, token_type_ids=[types, None])
        return engine

    engine = asyncio.run(submit())
    assert len(engine.queues) == 0 and engine.admission.queued_tokens == 0


def test_one_type_list_per_prompt(bert: LoadedModel) -> None:
    async def submit() -> None:
        engine = Engine(bert, _config(), CPU)
        with pytest.raises(ValueError, match="1 token type lists for 2 prompts"):
            engine.submit_many([[101, 102], [101, 102]], HIDDEN, token_type_ids=[[0, 0]])

    asyncio.run(submit())


def test_types_are_kept_only_where_they_change_the_forward(
    bert: LoadedModel, tiny_model_dir: Callable[[str], Path]
) -> None:
    async def kept(loaded: LoadedModel, types: list[int]) -> np.ndarray | None:
        engine = Engine(loaded, _config(enable_chunked_prefill=loaded.spec.is_causal), CPU)
        engine.submit_many([[101, 2000, 102]], HIDDEN, token_type_ids=[types])
        (request,) = engine.queues.by_id.values()
        return request.token_type_ids

    assert asyncio.run(kept(bert, [0, 0, 0])) is None  # all type 0 is what no types mean
    llama = load_model(str(tiny_model_dir("llama")), device=CPU)
    assert asyncio.run(kept(llama, [0, 1, 1])) is None  # no type table: ignored
    typed = asyncio.run(kept(bert, [0, 1, 1]))
    assert typed is not None and typed.dtype == np.int64 and typed.tolist() == [0, 1, 1]


def test_chunks_carry_their_slice_and_the_buffer_fills_zeros(bert: LoadedModel) -> None:
    # Encoders never run chunked; planning alone (no forward) shows how chunks slice the types.
    async def plan() -> None:
        engine = Engine(bert, _config(max_num_batched_tokens=8, enable_chunked_prefill=True), CPU)
        types = [0] * 5 + [1] * 7
        prompts = [[101, 102], list(range(1000, 1012))]
        engine.submit_many(prompts, HIDDEN, token_type_ids=[None, types])
        first = engine._plan_and_prepare()  # the short prompt and 6 of the typed one's 12 tokens
        assert first is not None and first.has_token_types
        plain, typed = first.chunks
        assert typed.token_type_ids is not None and plain.token_type_ids is None
        assert typed.token_type_ids.tolist() == types[:6]
        filled = engine.runner.host_types[first.slot, : first.num_tokens].tolist()
        assert filled == [0, 0, *types[:6]]
        second = engine._plan_and_prepare()
        assert second is not None and second.has_token_types
        assert second.chunks[0].token_type_ids is not None
        assert second.chunks[0].token_type_ids.tolist() == types[6:]

    asyncio.run(plan())
