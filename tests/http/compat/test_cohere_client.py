"""The official `cohere` SDK's v2 client against a real `poolserve serve` process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import pytest

from tests.http.test_server_process import free_port, start_server
from tests.tiny_rerankers import save_cross_encoder

pytestmark = pytest.mark.slow
API_KEY = "test-key"
QUERY = "what is the capital of france"
DOCUMENTS = [
    "the cat sat on the mat",
    "paris is the capital and largest city of france",
    "berlin is the capital of germany, a country next to france",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = save_cross_encoder("bert_cls", tmp_path_factory.mktemp("bert_ce"))
    port = free_port()
    args = ("--model", str(directory), "--served-model-name", "ce", "--api-key", API_KEY)
    process = start_server(port, *args)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def test_cohere_v2_rerank_equals_the_servers_own_answer(server: str) -> None:
    client = cohere.ClientV2(base_url=server, api_key=API_KEY)
    answer = client.rerank(model="ce", query=QUERY, documents=DOCUMENTS)
    own = httpx.post(
        f"{server}/v2/rerank",
        json={"model": "ce", "query": QUERY, "documents": DOCUMENTS},
        headers={"authorization": f"Bearer {API_KEY}"},
    ).json()
    assert answer.id is not None and answer.id.startswith("score-")
    assert [r.index for r in answer.results] == [r["index"] for r in own["results"]]
    assert [r.relevance_score for r in answer.results] == [
        r["relevance_score"] for r in own["results"]
    ]
    assert sorted(r.index for r in answer.results) == [0, 1, 2]
    top = client.rerank(
        model="ce", query=QUERY, documents=DOCUMENTS, top_n=1, max_tokens_per_doc=64
    )
    assert [r.index for r in top.results] == [answer.results[0].index]


def test_cohere_client_errors_map_to_its_exceptions(server: str) -> None:
    with pytest.raises(cohere.errors.BadRequestError):
        cohere.ClientV2(base_url=server, api_key=API_KEY).rerank(
            model="ce", query=QUERY, documents=[]
        )
    with pytest.raises(cohere.errors.UnauthorizedError):
        cohere.ClientV2(base_url=server, api_key="wrong").rerank(
            model="ce", query=QUERY, documents=DOCUMENTS
        )
