"""Late chunking's span pool: one mean per token range, equal to a naive reference whatever the
chunking and batching; the embedding head on every row; its parameters checked and split per
prompt; the engine computes every position of such a request (no prefix-cache hit) and the
parameters cross the engine-core boundary."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from poolserve.engine.loop import Engine
from poolserve.engine.sched.prefix_cache import CacheUse
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.pooling import (
    CloneStats,
    InvalidPoolingParamsError,
    PoolingModelInfo,
    PoolingParams,
    PoolingTask,
    PoolingType,
    build_pooler,
    validate_params,
)
from poolserve.pooling.heads import TokenEmbeddingHead
from poolserve.pooling.methods import SpanMeanPool, build_method
from poolserve.pooling.pooler import RequestPooler
from poolserve.types import protocol
from poolserve.types.validation import prompt_params, request_spans
from tests.engine.test_engine import CPU, _config
from tests.pooling.util import CHUNK_SIZES, SimRequest, assert_close, feed_chunked, run_steps
from tests.tiny_models import build_hf_model

HIDDEN = 16
NUM_TOKENS = 150
# single tokens, chunk-crossing ranges, overlapping ranges, the whole prompt, out of order
SPANS = ((0, 1), (3, 40), (30, 71), (0, NUM_TOKENS), (149, 150), (64, 65), (10, 12))


def _prompt(num_tokens: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen) * 3 + 1
    return hidden, torch.randint(0, 12, (num_tokens,), generator=gen).tolist()


def _naive(hidden: torch.Tensor, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.stack([hidden[s:e].double().mean(dim=0) for s, e in spans]).float()


def _span_pooler(spans: tuple[tuple[int, int], ...], async_scheduling: bool) -> RequestPooler:
    """A span pooler whose head returns the span means unchanged."""
    stats = CloneStats()
    # the model's own pooling type does not matter: spans pick the span pool
    method = build_method(
        PoolingType.LAST, async_scheduling=async_scheduling, stats=stats, token_spans=spans
    )
    assert isinstance(method, SpanMeanPool) and method.pooling_type is PoolingType.MEAN
    return RequestPooler(method, TokenEmbeddingHead(normalize=False), stats)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_span_means_equal_naive_for_any_chunking(
    chunk_size: int | None, async_scheduling: bool
) -> None:
    hidden, ids = _prompt(NUM_TOKENS, seed=4)
    pooler = _span_pooler(SPANS, async_scheduling)
    out = feed_chunked(pooler, hidden, ids, chunk_size, async_scheduling)
    assert_close(out, _naive(hidden, SPANS))
    assert not pooler.is_open


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_span_pool_batched_with_other_requests(async_scheduling: bool) -> None:
    prompts = [_prompt(n, seed=n) for n in (150, 9, 77)]
    spans = [SPANS, ((0, 9), (2, 3)), ((5, 77),)]
    requests = [
        SimRequest(_span_pooler(s, async_scheduling), hidden, tuple(ids))
        for s, (hidden, ids) in zip(spans, prompts, strict=True)
    ]
    stats = CloneStats()
    mean = build_method(PoolingType.MEAN, async_scheduling=async_scheduling, stats=stats)
    plain = RequestPooler(mean, TokenEmbeddingHead(normalize=False), stats)
    requests.append(SimRequest(plain, prompts[0][0], tuple(prompts[0][1])))
    outputs = run_steps(requests, token_budget=13, async_scheduling=async_scheduling)
    for out, s, (hidden, _) in zip(outputs, spans, prompts, strict=False):
        assert_close(out, _naive(hidden, s))
    assert_close(outputs[-1], prompts[0][0].double().mean(dim=0).float())


def _info() -> PoolingModelInfo:
    torch.manual_seed(1)
    projection = nn.Sequential(nn.Linear(HIDDEN, 8), nn.Tanh())
    return PoolingModelInfo(
        is_decoder=False,
        hidden_size=HIDDEN,
        embed_projection=projection,
        embed_output_size=8,
        supports_matryoshka=True,
    )


@pytest.mark.parametrize("dimensions", [None, 5])
def test_the_embedding_head_runs_on_every_span(dimensions: int | None) -> None:
    info = _info()
    params = PoolingParams(task=PoolingTask.EMBED, dimensions=dimensions, token_spans=(SPANS,))
    pooler = build_pooler(info, params, async_scheduling=False, stats=CloneStats())
    hidden, ids = _prompt(NUM_TOKENS, seed=9)
    out = feed_chunked(pooler, hidden, ids, 32, async_scheduling=False)
    assert info.embed_projection is not None
    with torch.no_grad():
        projected = info.embed_projection(_naive(hidden, SPANS))  # [spans, 8]
    want = F.normalize(projected[:, : dimensions or 8], dim=-1)
    assert out.shape == (len(SPANS), dimensions or 8)
    assert_close(out, want)


def _refused(params: PoolingParams, info: PoolingModelInfo | None = None) -> str:
    with pytest.raises(InvalidPoolingParamsError) as caught:
        validate_params(info or _info(), params)
    assert caught.value.param_name == "token_spans"
    return caught.value.message


def test_token_spans_apply_to_embed_only_and_must_be_ranges() -> None:
    spans = ((0, 2),)
    validate_params(_info(), PoolingParams(task=PoolingTask.EMBED, token_spans=(spans,)))
    assert "does not apply" in _refused(
        PoolingParams(task=PoolingTask.TOKEN_EMBED, token_spans=(spans,))
    )
    embed = PoolingTask.EMBED
    for bad in (((2, 2),), ((3, 1),), ((-1, 2),)):
        assert "0 <= start < end" in _refused(PoolingParams(task=embed, token_spans=(bad,)))
    assert "no spans" in _refused(PoolingParams(task=embed, token_spans=((),)))
    assert "one prompt" in _refused(PoolingParams(task=embed, token_spans=()))
    both = PoolingParams(task=embed, token_spans=(spans,), prompt_tokens=1)
    assert "prompt_tokens" in _refused(both)


def test_each_prompt_gets_its_own_spans_within_it() -> None:
    params = PoolingParams(task=PoolingTask.EMBED, token_spans=(((0, 3), (1, 2)), ((0, 1),)))
    first, second = prompt_params(params, [3, 1])
    assert request_spans(first) == ((0, 3), (1, 2)) and request_spans(second) == ((0, 1),)
    plain = PoolingParams(task=PoolingTask.EMBED)
    assert prompt_params(plain, [4, 5]) == [plain, plain] and request_spans(plain) is None
    with pytest.raises(InvalidPoolingParamsError, match="past the 2 tokens of prompt 0"):
        prompt_params(params, [2, 1])
    with pytest.raises(InvalidPoolingParamsError, match="for 3 prompts"):
        prompt_params(params, [3, 1, 1])
    twice = PoolingParams(task=PoolingTask.EMBED, token_spans=(((0, 1), (0, 1)),))
    with pytest.raises(InvalidPoolingParamsError, match="2 spans for 1 tokens"):
        prompt_params(twice, [1])
    with pytest.raises(InvalidPoolingParamsError, match="2 prompts' spans"):
        request_spans(params)


def test_token_spans_cross_the_engine_core_boundary() -> None:
    params = PoolingParams(task=PoolingTask.EMBED, token_spans=(((0, 2), (2, 5)), ((1, 3),)))
    prompts = [np.array([1, 2, 3, 4, 5]), np.array([6, 7, 8])]
    lengths, typed, _ = protocol.flat_prompts(prompts, [None, None])
    message = protocol.Submit([1, 2], lengths, params, 0, typed)
    decoded = protocol.decode_to_core(protocol.encode(message))
    assert isinstance(decoded, protocol.Submit)
    assert decoded.params == params and decoded.params.token_spans == params.token_spans


# ---- the engine: chunked prefill and the prefix cache ------------------------------------------
PROMPT = torch.randint(1000, 20000, (70,), generator=torch.Generator().manual_seed(2)).tolist()
PROMPT_SPANS = ((0, 1), (1, 33), (20, 70), (69, 70))


@pytest.fixture(scope="module")
def llama(tiny_model_dir: Callable[[str], Path]) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), device=CPU)


def _reference() -> np.ndarray:
    """transformers over the whole prompt, each span's mean, L2-normalised (the embed head)."""
    model = build_hf_model("llama")
    with torch.inference_mode():
        states = model.base_model(input_ids=torch.tensor([PROMPT])).last_hidden_state[0]
    return F.normalize(_naive(states.float(), PROMPT_SPANS), dim=-1).numpy()


def test_a_span_request_computes_every_position_whatever_is_cached(llama: LoadedModel) -> None:
    """A LAST request caches the prompt's blocks; the span request must not start past them."""
    embed = PoolingParams(task=PoolingTask.EMBED)  # LAST on a decoder: shares the cache
    spans = PoolingParams(task=PoolingTask.EMBED, token_spans=(PROMPT_SPANS,))

    async def scenario() -> tuple[np.ndarray, Engine]:
        engine = Engine(llama, _config(max_num_batched_tokens=16, block_size=8), CPU)
        engine.start()
        try:
            await engine.submit(PROMPT, embed)
            hits = engine.blocks.num_hit_tokens
            (future,) = engine.submit_many([PROMPT], spans)
            request = engine.queues.request_of(future)
            assert request is not None and request.cache_use is CacheUse.DONATE
            output = await future
            assert engine.blocks.num_hit_tokens == hits  # nothing was read from the cache
            return output.data, engine
        finally:
            await engine.stop()

    data, engine = asyncio.run(scenario())
    assert engine.prefix_caching
    assert data.shape == (len(PROMPT_SPANS), llama.spec.hidden_size)
    np.testing.assert_allclose(data, _reference(), rtol=1e-4, atol=1e-5)


def test_the_engine_refuses_spans_past_a_prompt(llama: LoadedModel) -> None:
    async def scenario() -> None:
        engine = Engine(llama, _config(), CPU)
        engine.start()
        try:
            params = PoolingParams(task=PoolingTask.EMBED, token_spans=(((0, 71),),))
            with pytest.raises(InvalidPoolingParamsError, match="past the 70 tokens"):
                engine.submit_many([PROMPT], params)
            assert engine.admission.queued_requests == 0
        finally:
            await engine.stop()

    asyncio.run(scenario())
