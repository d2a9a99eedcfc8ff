"""vLLM's chunked processing: embed inputs longer than the model, pooled in slices and averaged.

The reference is recomputed from transformers directly: the whole tokenization cut into
consecutive slices of the model's length, transformers' model run on each slice, pooled as the
model pools (MiniLM: sentence-transformers' mean, then normalised; a decoder: its last token),
the slices averaged with their token counts as weights, the average normalised.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from poolserve.config.pooler import MAX_EMBED_LEN, parse_pooler_config
from poolserve.config.settings import ServerSettings
from poolserve.frontend.chunked import cut, slice_params
from poolserve.frontend.jobs import TextJob
from poolserve.frontend.pipeline import as_completed, gather, submit_job
from poolserve.frontend.state import TextLimits
from poolserve.http.app import create_app
from poolserve.observability.tracing import NO_TRACE
from poolserve.offline import AsyncPoolingEngine, PoolingEngine
from poolserve.types.errors import ClientDisconnectedError, InvalidRequestError
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.http.serving import assert_close
from tests.tiny_decoders import build_hf_decoder, decoder_dirs
from tests.tiny_models import minilm_path

SIZE = 64  # max_model_len: one slice
CAP = 300  # max_embed_len
CHUNKED = json.dumps({"enable_chunked_processing": True, "max_embed_len": CAP})
SENTENCE = "pooling services embed long documents in slices and average them back together "
ONE = SENTENCE * 2  # 30 tokens: one slice
TWO = SENTENCE * 7  # 100 tokens: two slices
SEVERAL = SENTENCE * 21  # 296 tokens: five slices, the last of 40
TOO_LONG = SENTENCE * 22  # 310 tokens
TEXTS = [ONE, TWO, SEVERAL]
DECODER = "gemma3_base"  # causal, sliding windows shorter than a slice, LAST pooling


@cache
def _tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(minilm_path()))


@cache
def _minilm() -> torch.nn.Module:
    return AutoModel.from_pretrained(str(minilm_path())).eval()


def _ids(text: str, **options: Any) -> list[int]:
    return list(_tokenizer()(text, **options)["input_ids"])


def _sliced(ids: Sequence[int], pool: Callable[[list[int]], torch.Tensor]) -> np.ndarray:
    """Each slice pooled and normalised, averaged by token counts, the average normalised."""
    pieces = [list(ids[start : start + SIZE]) for start in range(0, len(ids), SIZE)]
    vectors = torch.stack([torch.nn.functional.normalize(pool(p), dim=-1) for p in pieces])
    weights = torch.tensor([float(len(p)) for p in pieces])
    mean = (weights[:, None] * vectors.double()).sum(0) / weights.sum()
    return torch.nn.functional.normalize(mean, dim=-1).float().numpy()


def _minilm_mean(ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return _minilm()(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)


def minilm_reference(text_or_ids: str | Sequence[int], **options: Any) -> np.ndarray:
    ids = _ids(text_or_ids, **options) if isinstance(text_or_ids, str) else text_or_ids
    return _sliced(ids, _minilm_mean)


@pytest.fixture(scope="module")
def engine() -> Iterator[PoolingEngine]:
    """The bundled MiniLM at max_model_len 64 with chunked processing up to 300 tokens."""
    with PoolingEngine(
        None, served_model_name="m", max_model_len=SIZE, pooler_config=CHUNKED
    ) as served:
        yield served


def _post(engine: PoolingEngine, path: str, body: dict[str, Any], status: int = 200) -> Any:
    reply = engine.request("POST", path, orjson.dumps(body))
    assert reply.status == status, reply.body
    return orjson.loads(reply.body)


def test_slice_counts_of_the_test_texts() -> None:
    counts = [-(-len(_ids(text)) // SIZE) for text in TEXTS]
    assert counts == [1, 2, 5]
    assert len(_ids(SEVERAL)) <= CAP < len(_ids(TOO_LONG))


def test_embeddings_equal_the_sliced_reference_and_count_each_prompt_once(
    engine: PoolingEngine,
) -> None:
    answer = _post(engine, "/v1/embeddings", {"input": TEXTS})
    for item, text in zip(answer["data"], TEXTS, strict=True):
        assert_close(item["embedding"], minilm_reference(text))
    assert answer["usage"]["prompt_tokens"] == sum(len(_ids(text)) for text in TEXTS)
    # token ids at exact slice boundaries: 64, 128 and max_embed_len itself
    prompts = [list(range(1000, 1000 + n)) for n in (SIZE, 2 * SIZE, CAP)]
    answer = _post(engine, "/v1/embeddings", {"input": prompts})
    for item, ids in zip(answer["data"], prompts, strict=True):
        assert_close(item["embedding"], minilm_reference(ids))
    assert answer["usage"]["prompt_tokens"] == SIZE + 2 * SIZE + CAP


def test_pooling_route_and_its_stream(engine: PoolingEngine) -> None:
    answer = _post(engine, "/v1/pooling", {"input": TEXTS, "task": "embed"})
    for item, text in zip(answer["data"], TEXTS, strict=True):
        assert_close(item["data"], minilm_reference(text))
    reply = engine.request(
        "POST", "/v1/pooling", orjson.dumps({"input": TEXTS, "task": "embed", "stream": True})
    )
    assert reply.status == 200, reply.body
    lines = [orjson.loads(line) for line in reply.body.splitlines()]
    assert sorted(line["index"] for line in lines[:-1]) == [0, 1, 2]  # one line per input
    for line in lines[:-1]:
        assert_close(line["data"], minilm_reference(TEXTS[line["index"]]))
    assert lines[-1]["usage"]["prompt_tokens"] == sum(len(_ids(text)) for text in TEXTS)


def test_compat_routes_take_the_same_path(engine: PoolingEngine) -> None:
    want = [minilm_reference(text) for text in TEXTS]
    tei = _post(engine, "/embed", {"inputs": TEXTS})
    infinity = _post(engine, "/embeddings", {"input": TEXTS, "model": "m"})
    cohere = _post(
        engine,
        "/v2/embed",
        {
            "texts": TEXTS,
            "model": "m",
            "input_type": "search_document",
            "embedding_types": ["float"],
        },
    )
    for index, reference in enumerate(want):
        assert_close(tei[index], reference)
        assert_close(infinity["data"][index]["embedding"], reference)
        assert_close(cohere["embeddings"]["float"][index], reference)


def test_python_api(engine: PoolingEngine) -> None:
    pooled = engine.embed(TEXTS)
    for item, text in zip(pooled, TEXTS, strict=True):
        assert_close(item.data, minilm_reference(text))
        assert item.prompt_tokens == len(_ids(text))
    # unnormalised: the plain weighted mean of the raw slice embeddings
    (raw,) = engine.embed([TWO], normalize=False)
    ids = _ids(TWO)
    slices = [_minilm_mean(ids[:SIZE]), _minilm_mean(ids[SIZE:])]
    want = (SIZE * slices[0] + (len(ids) - SIZE) * slices[1]) / len(ids)
    assert_close(raw.data, want)


def test_concurrent_requests_each_get_their_own_answer(engine: PoolingEngine) -> None:
    want = {text: minilm_reference(text) for text in TEXTS}

    def call(index: int) -> tuple[str, Any]:
        text = TEXTS[index % len(TEXTS)]
        if index % 3 == 0:
            return text, engine.embed([text])[0].data
        path, field = ("/v1/embeddings", "embedding") if index % 3 == 1 else ("/v1/pooling", "data")
        answer = _post(engine, path, {"input": [text, "a short neighbour"]})
        return text, answer["data"][0][field]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(24)))
    for text, got in results:
        assert_close(got, want[text])


def test_an_input_over_max_embed_len_is_refused_with_vllms_message(
    engine: PoolingEngine,
) -> None:
    for body, count in (
        ({"input": [ONE, TOO_LONG]}, len(_ids(TOO_LONG))),
        ({"input": list(range(1000, 1000 + CAP + 1))}, CAP + 1),
    ):
        error = _post(engine, "/v1/embeddings", body, status=400)["error"]
        assert error["message"] == (
            f"This model's maximum embedding input length is {CAP} tokens. However, you "
            f"requested {count} tokens in the input for embedding generation. Please reduce "
            "the length of the input."
        )
        assert error["param"] == "input"
    # truncation applies first, at max_embed_len for -1, and the rest is chunked
    answer = _post(engine, "/v1/embeddings", {"input": TOO_LONG, "truncate_prompt_tokens": -1})
    want = minilm_reference(TOO_LONG, truncation=True, max_length=CAP)
    assert_close(answer["data"][0]["embedding"], want)
    assert answer["usage"]["prompt_tokens"] == CAP
    answer = _post(engine, "/v1/embeddings", {"input": TWO, "truncate_prompt_tokens": 80})
    assert_close(
        answer["data"][0]["embedding"], minilm_reference(TWO, truncation=True, max_length=80)
    )
    _post(engine, "/v1/embeddings", {"input": TWO, "truncate_prompt_tokens": CAP + 1}, 400)


def test_token_level_tasks_keep_the_models_limit(engine: PoolingEngine) -> None:
    # MiniLM's sentence-transformers length cuts every other task's prompt at max_model_len
    answer = _post(engine, "/v1/pooling", {"input": TWO, "task": "token_embed"})
    assert len(answer["data"][0]["data"]) == SIZE
    assert answer["usage"]["prompt_tokens"] == SIZE


def test_character_bounds_scale_with_max_embed_len(engine: PoolingEngine) -> None:
    # 30 words of 150 characters: over 64 characters a token of max_model_len, 32 tokens
    text = " ".join(["x" * 150] * 30)
    assert len(text) > 64 * SIZE and len(_ids(text)) < SIZE
    answer = _post(engine, "/v1/embeddings", {"input": text})
    assert_close(answer["data"][0]["embedding"], minilm_reference(text))
    settings = ServerSettings(model=None, pooler_config=CHUNKED)
    assert TextLimits.derive(settings, SIZE, CAP).max_input_chars == 64 * CAP
    assert TextLimits.derive(settings, SIZE).max_input_chars == 64 * SIZE


@pytest.mark.parametrize(
    ("config", "limit", "what"),
    [
        ({"enable_chunked_processing": True}, SIZE, "maximum context length"),
        ({"max_embed_len": 40}, 40, "maximum embedding input length"),
    ],
)
def test_the_cap_alone(config: dict[str, Any], limit: int, what: str) -> None:
    """Chunking without max_embed_len caps at the model's length; max_embed_len without
    chunking caps an embed input, as vLLM's older code, without slicing anything."""
    settings = ServerSettings(
        model=None, served_model_name="m", max_model_len=SIZE, pooler_config=json.dumps(config)
    )
    prompt = list(range(1000, 1000 + limit + 1))
    with TestClient(create_app(settings)) as client:
        refused = client.post("/v1/embeddings", json={"input": prompt})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"].startswith(
            f"This model's {what} is {limit} tokens. However, you requested {limit + 1} tokens"
        )
        answer = client.post("/v1/embeddings", json={"input": prompt[:limit]}).json()
        assert_close(answer["data"][0]["embedding"], minilm_reference(prompt[:limit]))
        # the cap is the embed task's: a token-level task keeps the model's own
        tokens = client.post("/v1/pooling", json={"input": prompt[:limit], "task": "token_embed"})
        assert tokens.status_code == 200


class _Leaves:
    """A caller that leaves once the engine has run a step of its work."""

    trace = NO_TRACE

    def __init__(self, engine: AsyncPoolingEngine) -> None:
        self.engine = engine

    def routed(self, model_name: str, lora_name: str | None) -> None:
        """Nothing to account."""

    def tokenized(self, started: float, ended: float, num_inputs: int, num_tokens: int) -> None:
        """Nothing to account."""

    def admitted(self, task: PoolingTask, num_tokens: int) -> None:
        """Nothing to account."""

    def on_leave(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Calls `callback` once a step has run; what it returns stops the watch."""
        core = self.engine.state.core
        assert core is not None

        async def watch() -> None:
            while core.engine.num_steps == 0:
                await asyncio.sleep(0.001)
            callback()

        return asyncio.ensure_future(watch()).cancel


def test_a_caller_that_leaves_cancels_every_slice() -> None:
    prompts = [list(range(1000, 1000 + CAP))] * 3  # 15 slices, one a step

    async def run() -> list[tuple[int, int]]:
        async with AsyncPoolingEngine(
            None, max_model_len=SIZE, max_num_batched_tokens=SIZE, pooler_config=CHUNKED
        ) as engine:
            core = engine.state.core
            assert core is not None
            admission = core.engine.admission
            left = []
            for streamed in (False, True):
                before = core.engine.num_steps
                job = TextJob(PoolingTask.EMBED, prompts)
                run = await submit_job(engine.state, job, _Leaves(engine))
                assert len(run.futures) == 15
                if streamed:
                    async with aclosing(as_completed(run)) as outputs:
                        await anext(outputs)  # the first input's last slice: then it leaves
                else:
                    with pytest.raises(ClientDisconnectedError):
                        await gather(run)
                for _ in range(500):
                    if admission.queued_requests == 0:
                        break
                    await asyncio.sleep(0.01)
                left.append((admission.queued_requests, admission.queued_tokens))
                assert core.engine.num_steps - before < 15  # the rest never ran
                assert all(f.done() for f in run.futures)
            return left

    assert asyncio.run(run()) == [(0, 0), (0, 0)]


def test_a_tiny_decoder_pools_each_slice_at_its_last_token(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    directory = decoder_dirs(tmp_path_factory)(DECODER)
    settings = ServerSettings(
        model=str(directory), served_model_name="d", max_model_len=SIZE, pooler_config=CHUNKED
    )
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/embeddings", json={"input": TEXTS})
        assert response.status_code == 200, response.text
        answer = response.json()
    model = build_hf_decoder(DECODER)

    def last(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]

    for item, text in zip(answer["data"], TEXTS, strict=True):
        assert_close(item["embedding"], _sliced(_ids(text), last))
    assert answer["usage"]["prompt_tokens"] == sum(len(_ids(text)) for text in TEXTS)


def test_absurd_max_embed_len_is_refused_at_start(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    with pytest.raises(ValueError, match="max_embed_len"):
        parse_pooler_config(json.dumps({"max_embed_len": MAX_EMBED_LEN + 1}))
    with pytest.raises(ValueError, match="max_embed_len"):
        parse_pooler_config(json.dumps({"max_embed_len": 0}))
    config = {"enable_chunked_processing": True, "max_embed_len": 5000}
    settings = ServerSettings(
        model=str(tiny_model_dir("bert")),
        pooler_config=json.dumps(config),
        max_num_queued_tokens=4096,
    )
    refused = pytest.raises(ValueError, match=r"max_embed_len \(5000\) makes 5000 queued tokens")
    with refused, TestClient(create_app(settings)):
        pass
    # one slice per queued request: 5000 tokens at max_model_len 64 make 79 slices
    settings = ServerSettings(
        model=str(tiny_model_dir("bert")),
        pooler_config=json.dumps(config),
        max_model_len=SIZE,
        max_num_queued_requests=64,
    )
    refused = pytest.raises(ValueError, match=r"makes 79 queued requests \(79 slices of 64")
    with refused, TestClient(create_app(settings)):
        pass


def test_cut_and_the_parameter_groups() -> None:
    prompts, types, slicing = cut([[1, 2, 3, 4, 5], [6], [7, 8]], [None, [0], [0, 1]], 2, True)
    assert prompts == [[1, 2], [3, 4], [5], [6], [7, 8]]
    assert types == [None, None, None, [0], [0, 1]]
    assert slicing.bounds == (0, 3, 4, 5) and slicing.counts() == [3, 1, 1]
    assert [slicing.input_of(i) for i in range(5)] == [0, 0, 0, 1, 2]
    params = PoolingParams(PoolingTask.EMBED)
    assert slice_params(slicing, params) == [(params, [0, 1, 2, 3, 4])]
    # a prompt left out of pooling (include_prompt: false) is skipped in first slices only
    skipping = PoolingParams(PoolingTask.EMBED, prompt_tokens=1)
    rest = PoolingParams(PoolingTask.EMBED)
    assert slice_params(slicing, skipping) == [(skipping, [0, 3, 4]), (rest, [1, 2])]
    with pytest.raises(InvalidRequestError, match="fill the first slice"):
        slice_params(slicing, PoolingParams(PoolingTask.EMBED, prompt_tokens=2))
