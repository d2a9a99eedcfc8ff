"""The Python API: outputs equal sentence-transformers / transformers and the server's answers.

`PoolingEngine` and `AsyncPoolingEngine` run the server's own app in process; these tests hold
them to the references the HTTP tests use, plus what only a library caller meets: calls larger
than a request, a full queue (wait, not 429), calls from several threads, cancellation.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer, util

from poolserve.frontend.state import ServiceState
from poolserve.offline import AsyncPoolingEngine, PoolingEngine
from poolserve.offline.app_client import AppClient
from poolserve.offline.engine import PIECE_INPUTS
from poolserve.types.errors import APIError, InvalidPoolingParamsError
from tests.http.serving import hf_logits

TEXTS = [
    f"text {i}: " + "some words about the weather " * (i % 9 + 1) for i in range(PIECE_INPUTS + 45)
]


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path) -> Iterator[PoolingEngine]:
    with PoolingEngine(str(minilm_dir)) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(minilm_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_embed_equals_sentence_transformers_across_pieces(
    minilm: PoolingEngine, reference: SentenceTransformer
) -> None:
    got = minilm.embed(TEXTS)  # more inputs than one piece: several pieces, order kept
    want = reference.encode(TEXTS, convert_to_numpy=True)
    np.testing.assert_allclose(np.stack([p.data for p in got]), want, atol=1e-5)
    tokens = [len(reference.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert [p.prompt_tokens for p in got] == tokens
    np.testing.assert_allclose(minilm.embed_array(TEXTS[:3]), want[:3], atol=1e-5)


def test_embed_equals_the_servers_answer(minilm: PoolingEngine) -> None:
    body = {"input": TEXTS[:5], "normalize": False, "encoding_format": "base64"}
    reply = minilm.request("POST", "/v1/embeddings", json.dumps(body).encode())
    assert reply.status == 200
    items = json.loads(reply.body)["data"]
    served = [np.frombuffer(base64.b64decode(i["embedding"]), dtype="<f4") for i in items]
    got = minilm.embed(TEXTS[:5], normalize=False)
    np.testing.assert_array_equal(np.stack([p.data for p in got]), np.stack(served))


def test_request_takes_a_dict_or_the_bodys_own_bytes(minilm: PoolingEngine) -> None:
    body = {"input": TEXTS[:2], "encoding_format": "base64"}
    as_dict = minilm.request("POST", "/v1/embeddings", body)
    as_bytes = minilm.request("POST", "/v1/embeddings", json.dumps(body).encode())
    assert as_dict.status == as_bytes.status == 200
    data = [[i["embedding"] for i in json.loads(r.body)["data"]] for r in (as_dict, as_bytes)]
    assert data[0] == data[1]
    with pytest.raises(TypeError, match="body must be bytes, str or a dict, not list"):
        minilm.request("POST", "/v1/embeddings", [1, 2])  # type: ignore[arg-type]


def test_request_answers_from_the_started_engine(minilm: PoolingEngine) -> None:
    """The app request() builds serves the engine's own state: ready at once, no second start."""
    core = minilm.engine.state.core
    assert minilm.request("GET", "/ready").status == 200
    assert minilm.engine.state.core is core


def test_concurrent_first_requests_build_one_app(
    minilm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[AppClient] = []
    real_open = AppClient.open

    async def counted(state: ServiceState) -> AppClient:
        opened.append(await real_open(state))
        return opened[-1]

    monkeypatch.setattr(AppClient, "open", counted)

    async def run() -> list[int]:
        async with AsyncPoolingEngine(str(minilm_dir)) as engine:
            replies = await asyncio.gather(*(engine.request("GET", "/ready") for _ in range(8)))
            return [reply.status for reply in replies]

    assert asyncio.run(run()) == [200] * 8
    assert len(opened) == 1


def test_token_ids_and_texts_agree(minilm: PoolingEngine, reference: SentenceTransformer) -> None:
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS[:4]]
    from_ids = minilm.embed_array(ids)
    np.testing.assert_allclose(from_ids, minilm.embed_array(TEXTS[:4]), atol=1e-6)


def test_token_level_equals_the_servers_answer(minilm: PoolingEngine) -> None:
    body = {"input": TEXTS[:2], "task": "token_embed"}
    reply = minilm.request("POST", "/v1/pooling", json.dumps(body).encode())
    served = [np.asarray(i["data"], dtype=np.float32) for i in json.loads(reply.body)["data"]]
    got = minilm.encode(TEXTS[:2], "token_embed")
    for pooled, want in zip(got, served, strict=True):
        assert pooled.data.shape == want.shape and pooled.data.shape[0] == pooled.prompt_tokens
        np.testing.assert_allclose(pooled.data, want, atol=1e-6)


def test_score_and_rerank_equal_cosine_of_sentence_transformers(
    minilm: PoolingEngine, reference: SentenceTransformer
) -> None:
    query, documents = "what is the weather like", TEXTS[:6]
    vectors = reference.encode([query, *documents], convert_to_tensor=True)
    want = util.cos_sim(vectors[:1], vectors[1:])[0].numpy()
    np.testing.assert_allclose(minilm.score(query, documents), want, atol=1e-5)
    ranked = minilm.rerank(query, documents, top_n=3)
    assert [r.index for r in ranked] == list(np.argsort(-want, kind="stable")[:3])
    assert [r.document for r in ranked] == [documents[r.index] for r in ranked]
    np.testing.assert_allclose([r.score for r in ranked], np.sort(want)[::-1][:3], atol=1e-5)
    pairwise = minilm.score(documents[:3], documents[3:6])  # query i with document i
    np.testing.assert_allclose(
        pairwise, np.diag(util.cos_sim(vectors[1:4], vectors[4:7])), atol=1e-5
    )


def test_calls_from_several_threads_batch_together(minilm: PoolingEngine) -> None:
    alone = minilm.embed_array(TEXTS[:40])
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda i: minilm.embed_array(TEXTS[i * 10 : i * 10 + 10]), range(4))
        )
    np.testing.assert_allclose(np.concatenate(results), alone, atol=1e-6)


def test_classify_equals_transformers(tiny_model_dir: Callable[[str], Path]) -> None:
    texts = ["good", "bad and worse", "neutral words here"]
    with PoolingEngine(str(tiny_model_dir("llama_cls3"))) as engine:
        got = engine.classify(texts)
        raw = engine.classify(texts, use_activation=False)
        ids = [engine.model.tokenizer(t)["input_ids"] for t in texts]
    labels = ("negative", "neutral", "positive")
    for one, logits_only, prompt in zip(got, raw, ids, strict=True):
        logits = hf_logits("llama_cls3", prompt)
        np.testing.assert_allclose(one.probs, torch.softmax(logits, -1).numpy(), atol=1e-5)
        np.testing.assert_allclose(logits_only.probs, logits.numpy(), atol=1e-4)
        assert one.label == labels[int(torch.argmax(logits))]
        assert one.prompt_tokens == len(prompt)


def test_a_full_queue_waits_instead_of_refusing(minilm_dir: Path) -> None:
    # room for 4 queued prompts and 300 tokens: 60 inputs can only pass by waiting for room
    # and by pieces small enough, never by a 429
    limits = {"max_num_queued_requests": 4, "max_num_queued_tokens": 300}
    with PoolingEngine(str(minilm_dir), **limits) as engine:
        got = engine.embed_array(TEXTS[:60])
    with PoolingEngine(str(minilm_dir)) as engine:
        np.testing.assert_allclose(got, engine.embed_array(TEXTS[:60]), atol=1e-6)


def test_bad_calls_raise_clear_errors(minilm: PoolingEngine) -> None:
    with pytest.raises(TypeError, match="texts or lists of token ids"):
        minilm.embed(["a text", [1, 2, 3]])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        minilm.encode(["a"], "no-such-task")
    with pytest.raises(InvalidPoolingParamsError, match="dimensions"):
        minilm.embed(["a"], dimensions=100000)
    with pytest.raises(APIError, match="prompt"):  # the server's 400, raised as it is
        minilm.embed(["a"], prompt_name="no-such-prompt")
    with pytest.raises(ValueError, match="pair them"):
        minilm.score(["a", "b"], ["c", "d", "e"])
    assert minilm.embed([]) == []  # nothing to do is not an error


def test_a_cancelled_call_frees_its_work(minilm_dir: Path) -> None:
    async def run() -> tuple[int, int]:
        async with AsyncPoolingEngine(str(minilm_dir), max_num_batched_tokens=512) as engine:
            core = engine.state.core
            assert core is not None
            call = asyncio.ensure_future(engine.embed(TEXTS * 3))
            while core.engine.admission.queued_requests == 0:
                await asyncio.sleep(0.005)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            for _ in range(500):  # cancelled prompts leave the engine within a step or two
                if core.engine.admission.queued_requests == 0:
                    break
                await asyncio.sleep(0.01)
            after = core.engine.admission.queued_requests, core.engine.admission.queued_tokens
            await engine.embed(["still serving"])
            return after

    assert asyncio.run(run()) == (0, 0)


def test_several_models_are_called_by_name(tmp_path: Path, minilm_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    from poolserve.types.errors import ModelNotFoundError
    from tests.tiny_rerankers import save_cross_encoder

    reranker = save_cross_encoder("bert_cls", tmp_path / "reranker")
    models = tmp_path / "models.yaml"
    models.write_text(
        f"models:\n  - model: {minilm_dir}\n    served_model_name: embedder\n"
        f"  - model: {reranker}\n    served_model_name: reranker\n    max_model_len: 64\n"
    )
    query, documents = "capital of france", ["paris is in france", "a cat sat"]
    with PoolingEngine(models_config=str(models)) as engine:
        vectors = engine.embed_array(TEXTS[:3])  # the default model: the first
        scores = engine.score(query, documents, model="reranker")
        ranked = engine.rerank(query, documents, model="reranker")
        with pytest.raises(ModelNotFoundError):
            engine.embed(["a"], model="no-such-model")
    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    np.testing.assert_allclose(vectors, reference.encode(TEXTS[:3]), atol=1e-5)
    want = CrossEncoder(str(reranker), device="cpu").predict([(query, d) for d in documents])
    np.testing.assert_allclose(scores, want, atol=1e-5)
    assert [r.index for r in ranked] == list(np.argsort(-want, kind="stable"))
