"""Several models behind one server: the real MiniLM (an embedder) and a tiny cross-encoder.

Each model's answers equal sentence-transformers' (SentenceTransformer, CrossEncoder) and its
own single-model server's under concurrent mixed load; every route family with a `model` field
routes by it (404 in its own shape for an unknown name); TEI's routes serve the default model;
admission (429), metrics and the access log are per model. In process (TestClient over
`create_app`) and as a real `poolserve serve A B --api-server-count 1`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sentence_transformers import CrossEncoder, SentenceTransformer
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from poolserve.observability.logs import ACCESS_LOGGER, FIELDS_ATTR
from tests.http.serving import live_server, queue_taken
from tests.tiny_models import MINILM_DIR
from tests.tiny_rerankers import save_cross_encoder

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris is the capital and largest city of france",
    "the cat sat on the mat",
    "berlin is the capital of germany",
]
TEXTS = ["an embedding of a sentence", "another, somewhat longer sentence to embed", "short"]
EMBEDDER = ("minilm", "embedder")  # served names: the first is the one answers report
RERANKER = ("reranker", "ce")
# the reranker's own admission queue: more than the mixed load holds, few enough to fill
RERANKER_QUEUE = 64
Post = Callable[[str, dict[str, Any]], Any]
# what a request of the mixed load asks: an embedding of a text, or a (query, document) score
Key = tuple[str, ...]


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_cross_encoder("bert_cls", tmp_path_factory.mktemp("several") / "reranker")


@pytest.fixture(scope="module")
def models_file(reranker_dir: Path) -> Path:
    path = reranker_dir.parent / "models.yaml"
    path.write_text(
        f"""
models:
  - model: {MINILM_DIR}
    served_model_name: [{", ".join(EMBEDDER)}]
  - model: {reranker_dir}
    served_model_name: [{", ".join(RERANKER)}]
    max_model_len: 64
    max_num_queued_requests: {RERANKER_QUEUE}
"""
    )
    return path


@pytest.fixture(scope="module")
def client(models_file: Path) -> Iterator[TestClient]:
    with TestClient(create_app(ServerSettings(models_config=str(models_file)))) as started:
        yield started


@pytest.fixture(scope="module")
def embedder() -> SentenceTransformer:
    return SentenceTransformer(str(MINILM_DIR), device="cpu")


@pytest.fixture(scope="module")
def cross_encoder(reranker_dir: Path) -> CrossEncoder:
    return CrossEncoder(str(reranker_dir), device="cpu")


def _post(client: TestClient | httpx.Client, path: str, body: dict[str, Any]) -> Any:
    response = client.post(path, json=body)
    assert response.status_code == 200, (path, body, response.text)
    return response.json()


def _requests(embedder_name: str, reranker_name: str) -> list[tuple[str, dict[str, Any]]]:
    """A mixed load: embeddings, reranks and scores, each text a little different."""
    load: list[tuple[str, dict[str, Any]]] = []
    for i in range(6):
        texts = [f"{text} number {i}" for text in TEXTS]
        query = f"{QUERY} {i}"
        load += [
            ("/v1/embeddings", {"model": embedder_name, "input": texts}),
            ("/v1/rerank", {"model": reranker_name, "query": query, "documents": DOCUMENTS}),
            ("/score", {"model": reranker_name, "text_1": query, "text_2": DOCUMENTS}),
        ]
    return load


def _answers(post: Post, load: list[tuple[str, dict[str, Any]]], threads: int) -> dict[Key, Any]:
    """Every answer of the load (sent from `threads` threads at once), by what it asked."""

    def one(request: tuple[str, dict[str, Any]]) -> list[tuple[Key, Any]]:
        path, body = request
        answer = post(path, body)
        if path == "/v1/embeddings":
            data = zip(body["input"], answer["data"], strict=True)
            return [(("embed", text), item["embedding"]) for text, item in data]
        if path == "/v1/rerank":
            results = answer["results"]
            return [
                (("pair", body["query"], DOCUMENTS[r["index"]]), r["relevance_score"])
                for r in results
            ]
        return [
            (("pair", body["text_1"], DOCUMENTS[d["index"]]), d["score"]) for d in answer["data"]
        ]

    with ThreadPoolExecutor(threads) as pool:
        found: dict[Key, Any] = {}
        for pairs in pool.map(one, load):
            for key, value in pairs:
                # the same pair from /v1/rerank and /score: one score
                assert key not in found or found[key] == pytest.approx(value, abs=1e-6), key
                found[key] = value
    return found


def _check_references(
    answers: dict[Key, Any], embedder: SentenceTransformer, cross_encoder: CrossEncoder
) -> None:
    """Embeddings equal SentenceTransformer.encode's, scores CrossEncoder.predict's."""
    texts = [key[1] for key in answers if key[0] == "embed"]
    pairs = [(key[1], key[2]) for key in answers if key[0] == "pair"]
    assert len(texts) == 18 and len(pairs) == 18
    want = embedder.encode(texts)
    got = np.array([answers[("embed", t)] for t in texts], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5)
    scores = cross_encoder.predict(pairs)
    np.testing.assert_allclose([answers[("pair", *p)] for p in pairs], scores, atol=1e-5)


def test_mixed_load_equals_the_references_and_each_model_alone(
    client: TestClient,
    reranker_dir: Path,
    embedder: SentenceTransformer,
    cross_encoder: CrossEncoder,
) -> None:
    load = _requests("embedder", "ce")
    together = _answers(lambda path, body: _post(client, path, body), load, threads=6)
    _check_references(together, embedder, cross_encoder)
    alone = {}
    for settings in (
        ServerSettings(model=str(MINILM_DIR), served_model_name=list(EMBEDDER)),
        ServerSettings(model=str(reranker_dir), served_model_name=list(RERANKER), max_model_len=64),
    ):
        with TestClient(create_app(settings)) as single:
            names = settings.served_model_names
            mine = [(p, b) for p, b in load if b["model"] in names]
            alone.update(_answers(lambda path, body: _post(single, path, body), mine, threads=1))
    assert alone.keys() == together.keys()
    for key, value in together.items():
        np.testing.assert_allclose(value, alone[key], rtol=1e-5, atol=1e-6)


# (path, body without `model`, a name it routes to, the served name answers report)
ROUTES: list[tuple[str, dict[str, Any], str, str]] = [
    ("/v1/embeddings", {"input": "a text"}, "embedder", "minilm"),
    ("/v1/pooling", {"input": "a text"}, "ce", "reranker"),
    ("/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}, "ce", "reranker"),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}, "reranker", "reranker"),
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS}, "ce", "reranker"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}, "minilm", "minilm"),
    ("/v1/classify", {"input": QUERY}, "ce", "reranker"),
    ("/v2/embed", {"texts": ["a text"], "embedding_types": ["float"]}, "embedder", "minilm"),
    ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}, "ce", "reranker"),
    ("/embeddings", {"input": ["a text"]}, "minilm", "minilm"),  # Infinity's
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "raw_scores": False}, "ce", "reranker"),
    ("/tokenize", {"prompt": "a text"}, "ce", "reranker"),
    ("/detokenize", {"tokens": [101, 102]}, "embedder", "minilm"),
]


@pytest.mark.parametrize(("path", "body", "name", "served"), ROUTES)
def test_every_route_with_a_model_field_routes_by_it(
    client: TestClient,
    caplog: pytest.LogCaptureFixture,
    path: str,
    body: dict[str, Any],
    name: str,
    served: str,
) -> None:
    with caplog.at_level(logging.INFO, ACCESS_LOGGER):
        caplog.clear()
        answer = _post(client, path, {**body, "model": name})
        (line,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    # the access log names the model it went to (`model=` on the text line)
    assert getattr(line, FIELDS_ATTR)["model"] == served
    assert f" model={served} " in line.getMessage()
    if isinstance(answer, dict) and "model" in answer:
        assert answer["model"] == served
    if path == "/tokenize":
        assert answer["max_model_len"] == 64  # the reranker's, not MiniLM's 512
    missing = client.post(path, json={**body, "model": "no-such-model"})
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert all(repr(n) in error["message"] for n in (*EMBEDDER, *RERANKER))


def test_a_model_answers_only_for_its_own_tasks(client: TestClient) -> None:
    # routed by name: the cross-encoder embeds nothing, MiniLM classifies nothing
    for path, body in (
        ("/v1/embeddings", {"input": "a", "model": "ce"}),
        ("/v2/embed", {"texts": ["a"], "model": "reranker"}),
        ("/v1/classify", {"input": "a", "model": "embedder"}),
    ):
        response = client.post(path, json=body)
        assert response.status_code == 400 and "task" in response.text, (path, response.text)
    # /v1/pooling's default task is the named model's: an embedding, or one score
    assert len(_post(client, "/v1/pooling", {"input": "a"})["data"][0]["data"]) == 384
    assert len(_post(client, "/v1/pooling", {"input": "a", "model": "ce"})["data"][0]["data"]) == 1


def _cosine(embedder: SentenceTransformer, query: str, documents: list[str]) -> np.ndarray:
    vectors = embedder.encode([query, *documents])
    scores: np.ndarray = vectors[1:] @ vectors[0]  # unit vectors: cosine
    return scores


def test_tei_routes_serve_the_default_model(
    client: TestClient,
    models_file: Path,
    embedder: SentenceTransformer,
    cross_encoder: CrossEncoder,
) -> None:
    # the first model by default: MiniLM embeds, and TEI's /rerank compares embeddings
    np.testing.assert_allclose(
        _post(client, "/embed", {"inputs": TEXTS}), embedder.encode(TEXTS), atol=1e-5
    )
    ranks = _post(client, "/rerank", {"query": QUERY, "texts": DOCUMENTS})
    cosine = _cosine(embedder, QUERY, DOCUMENTS)
    np.testing.assert_allclose(
        [cosine[r["index"]] for r in ranks], [r["score"] for r in ranks], atol=1e-5
    )
    info = _post_get(client, "/info")
    assert (info["model"], info["served_model_name"]) == ("minilm", "minilm")
    # --default-model (any served name of a model) moves TEI's routes, and unnamed requests
    settings = ServerSettings(models_config=str(models_file), default_model="ce")
    with TestClient(create_app(settings)) as other:
        ranks = _post(other, "/rerank", {"query": QUERY, "texts": DOCUMENTS})
        want = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
        np.testing.assert_allclose(
            [want[r["index"]] for r in ranks], [r["score"] for r in ranks], atol=1e-5
        )
        refused = other.post("/embed", json={"inputs": "a"})  # a cross-encoder: TEI's Backend
        assert refused.status_code == 424 and refused.json()["error_type"] == "Backend"
        info = _post_get(other, "/info")
        assert (info["model"], info["max_model_len"]) == ("reranker", 64)
        assert "reranker" in info["model_type"]
        unnamed = _post(other, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert unnamed["model"] == "reranker"


def _post_get(client: TestClient, path: str) -> Any:
    response = client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_every_model_and_info_takes_a_model(client: TestClient) -> None:
    cards = _post_get(client, "/v1/models")["data"]
    assert [c["id"] for c in cards] == [*EMBEDDER, *RERANKER]  # each served name, as vLLM lists
    assert [c["max_model_len"] for c in cards] == [512, 512, 64, 64]
    assert [c["root"] for c in cards][2:] == ["reranker", "reranker"]
    infinity = _post_get(client, "/models")["data"]
    assert [(c["id"], c["capabilities"]) for c in infinity] == [
        ("minilm", ["embed"]),
        ("reranker", ["classify", "rerank"]),
    ]
    info = _post_get(client, "/info?model=ce")
    assert (info["model"], info["max_model_len"]) == ("reranker", 64)
    assert "score" in info["tasks"] and "embed" not in info["tasks"]
    assert _post_get(client, "/info?model=embedder")["model"] == "minilm"
    missing = client.get("/info?model=no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _sum(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, got, v in samples if n == name and labels.items() <= got.items())


def test_metrics_label_every_series_with_its_model(client: TestClient) -> None:
    before = _samples(client.get("/metrics").text)
    _post(client, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCUMENTS})
    _post(client, "/v1/embeddings", {"model": "embedder", "input": TEXTS})
    after = _samples(client.get("/metrics").text)
    assert all("model_name" in labels for _, labels, _ in after)  # vLLM's convention
    for model, endpoint in (("reranker", "/v1/rerank"), ("minilm", "/v1/embeddings")):
        grew = {
            name: _sum(after, name, model_name=model) - _sum(before, name, model_name=model)
            for name in (
                "poolserve_prompt_tokens_total",
                "poolserve_step_tokens_total",
                "poolserve_queue_duration_seconds_count",
                "poolserve_tokenization_duration_seconds_count",
            )
        }
        assert all(value > 0 for value in grew.values()), (model, grew)
        requests = _sum(after, "poolserve_requests_total", model_name=model, endpoint=endpoint)
        assert requests >= 1
        # each model's engine gauges, from its own engine
        assert _sum(after, "poolserve_ready", model_name=model) == 1
        assert _sum(after, "poolserve_kv_blocks_capacity", model_name=model) > 0
        assert _sum(after, "poolserve_waiting_requests", model_name=model) == 0


def test_a_full_queue_refuses_only_its_own_model(client: TestClient) -> None:
    def refused() -> float:
        samples = _samples(client.get("/metrics").text)
        return _sum(
            samples, "poolserve_rejected_requests_total", model_name="reranker", reason="queue_full"
        )

    before = refused()
    with queue_taken(client, RERANKER_QUEUE, 10, model="ce"):
        full = client.post(
            "/v1/rerank", json={"model": "ce", "query": QUERY, "documents": DOCUMENTS[:1]}
        )
        assert full.status_code == 429 and int(full.headers["retry-after"]) >= 1
        # the embedder's engine has its own queue: it answers
        _post(client, "/v1/embeddings", {"model": "embedder", "input": TEXTS})
        _post(client, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})  # the default's
    assert refused() == before + 1
    _post(client, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": DOCUMENTS})


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # the engine core cannot load it
        ("model: /no/such/model/dir\n    served_model_name: broken", "model '/no/such/model/dir'"),
        # the front end refuses its settings (an input longer than its queue could ever hold)
        (
            "model: {reranker}\n    served_model_name: broken\n    pooler_config: "
            "{{enable_chunked_processing: true, max_embed_len: 1000000}}",
            "model 'broken': --pooler-config: max_embed_len",
        ),
    ],
)
def test_a_model_that_fails_fails_the_start_naming_it(
    reranker_dir: Path, tmp_path: Path, entry: str, message: str
) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        f"models:\n  - model: {MINILM_DIR}\n  - {entry.format(reranker=reranker_dir)}\n"
    )
    with (
        pytest.raises(ValueError, match=message),
        TestClient(create_app(ServerSettings(models_config=str(path)))),
    ):
        pass


@pytest.fixture(scope="module")
def live(reranker_dir: Path) -> Iterator[httpx.Client]:
    """`poolserve serve MINILM RERANKER --api-server-count 1`: served as their folder names."""
    with live_server(str(MINILM_DIR), str(reranker_dir), "--api-server-count", "1") as http:
        yield http


def test_a_server_process_serves_both(
    live: httpx.Client, embedder: SentenceTransformer, cross_encoder: CrossEncoder
) -> None:
    names = [card["id"] for card in live.get("/v1/models").json()["data"]]
    assert names == [MINILM_DIR.name, "reranker"]  # positional models: their folder names
    answers = _answers(lambda path, body: _post(live, path, body), _requests(*names), threads=6)
    _check_references(answers, embedder, cross_encoder)
    missing = live.post("/v1/embeddings", json={"model": "no-such-model", "input": "a"})
    assert missing.status_code == 404
    samples = _samples(live.get("/metrics").text)
    for name in names:  # the core's engines, each asked at scrape time
        assert _sum(samples, "poolserve_kv_blocks_capacity", model_name=name) > 0
        assert _sum(samples, "poolserve_step_tokens_total", model_name=name) > 0
