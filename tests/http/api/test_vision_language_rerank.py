"""Image documents on /score and /rerank for a vision-language model, served in process on a
tiny Qwen3-VL checkpoint (tests/tiny_vl.py).

Read as Qwen3-VL-Reranker is served by vLLM (`--hf-overrides` reading two LM-head rows, vLLM's
qwen3_vl_reranker.jinja as `--score-template`): each pair's prompt, an image document rendered
as `<|vision_start|><|image_pad|><|vision_end|>`, equals sigmoid(logit[yes] - logit[no]) of
transformers' full model on the same rendered prompt, texts and images mixed, whole and
chunked (an image across steps); top_n, return_documents, N:N pairs, the instruction; what a
client gets wrong is a 400 before any engine work, and the patch budget is given back. The
same checkpoint served as an embedder scores an image document by the cosine of the two
embeddings (each image a one-message conversation of it), equal transformers' too. One real
`poolserve serve` process takes vLLM's flags and concurrent reranks (slow).
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_rerankers import save_cross_encoder
from tests.tiny_vl import Reference, image, save_tiny_vl

NAME = "vl"
TOLERANCE = 1e-4  # relative to the reference's scale (DESIGN.md's float32 bound)
YES_NO = ("w1", "w2")  # the tiny vocabulary's "no" and "yes"
OVERRIDES = {
    "architectures": ["Qwen3VLForSequenceClassification"],
    "classifier_from_token": list(YES_NO),
    "is_original_qwen3_reranker": True,
}
SYSTEM = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
DEFAULT_INSTRUCTION = "Given a search query, retrieve relevant candidates that answer the query."
# vLLM's examples/pooling/score/template/qwen3_vl_reranker.jinja, a space after "<Query>:" and
# "<Document>:" so the tiny word-level tokenizer reads the first word of each on its own
TEMPLATE = (
    SYSTEM + "<Instruct>: {{ instruction | default(instruct | default(messages | "
    'selectattr("role", "eq", "system") | map(attribute="content") | first | '
    'default("' + DEFAULT_INSTRUCTION + '", true), true), true) }}<Query>: {{\n'
    '    messages\n    | selectattr("role", "eq", "query")\n    | map(attribute="content")\n'
    "    | first\n}}\n<Document>: {{\n"
    '    messages\n    | selectattr("role", "eq", "document")\n    | map(attribute="content")\n'
    "    | first\n}}<|im_end|>\n<|im_start|>assistant\n\n"
)
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
QUERY = "w3 w4 w5"
PICTURES = [image(60, 40, seed=1), image(33, 90, seed=2), image(120, 120, seed=3)]
# documents by their parts: a string is a text, an int the index of a picture
DOCUMENTS: tuple[str | int, ...] = (0, "w6 w7", 1, "w8 w9 w10 w11", 2)


def _data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _part(document: str | int) -> dict[str, Any]:
    """vLLM's content part of one document."""
    if isinstance(document, str):
        return {"type": "text", "text": document}
    return {"type": "image_url", "image_url": {"url": _data_url(PICTURES[document])}}


PARTS = [_part(document) for document in DOCUMENTS]
BROKEN = {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vl("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="module")
def reference(directory: Path) -> Reference:
    return Reference(directory)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "qwen3_vl_reranker.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


@contextmanager
def _client(directory: Path, **settings: Any) -> Iterator[TestClient]:
    served = ServerSettings(
        model=str(directory), served_model_name=NAME, max_images_per_request=5, **settings
    )
    with TestClient(create_app(served)) as client:
        yield client


@pytest.fixture(scope="module", params=["whole", "chunked"])
def reranker(
    request: pytest.FixtureRequest, directory: Path, template_file: Path
) -> Iterator[TestClient]:
    """The reranker; chunked, a step of 16 tokens splits prompts and images across steps."""
    budget = {"max_num_batched_tokens": 16} if request.param == "chunked" else {}
    overrides = json.dumps(OVERRIDES)
    with _client(
        directory, hf_overrides=overrides, score_template=str(template_file), **budget
    ) as client:
        yield client


def _prompt(query: str, document: str | int, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The pair's prompt as vLLM's template renders it (an image document: the image text;
    Jinja drops the template's last newline, in transformers' rendering and so in vLLM's)."""
    content = document if isinstance(document, str) else IMAGE_TEXT
    return (
        f"{SYSTEM}<Instruct>: {instruction}<Query>: {query}\n<Document>: {content}"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def _expected(reference: Reference, query: str, document: str | int, **kwargs: str) -> float:
    """sigmoid(logit[yes] - logit[no]) at the last token of transformers' full model."""
    pictures = [] if isinstance(document, str) else [PICTURES[document]]
    logits = reference.last_logits(_prompt(query, document, **kwargs), pictures)
    no, yes = reference.tokenizer.convert_tokens_to_ids(list(YES_NO))
    return float(torch.sigmoid(logits[yes] - logits[no]))


def _num_tokens(reference: Reference, query: str, document: str | int) -> int:
    """The pair's prompt length, each image placeholder expanded by the processor's grid."""
    pictures = [] if isinstance(document, str) else [PICTURES[document]]
    ids, _ = reference.inputs(_prompt(query, document), pictures)
    return int(ids.shape[1])


def _close(got: float, want: float) -> None:
    assert abs(got - want) <= TOLERANCE * max(abs(want), 1e-6), (got, want)


def _ok(response: Any) -> Any:
    assert response.status_code == 200, response.text
    return response.json()


def test_score_equals_transformers(reranker: TestClient, reference: Reference) -> None:
    """1:N /score over texts and images mixed: each score and the prompt tokens (the images'
    expanded placeholders counted)."""
    body = {"model": NAME, "queries": QUERY, "documents": {"content": PARTS}}
    answer = _ok(reranker.post("/score", json=body))
    assert [item["index"] for item in answer["data"]] == list(range(len(DOCUMENTS)))
    for item, document in zip(answer["data"], DOCUMENTS, strict=True):
        _close(item["score"], _expected(reference, QUERY, document))
    tokens = sum(_num_tokens(reference, QUERY, document) for document in DOCUMENTS)
    assert answer["usage"]["prompt_tokens"] == tokens
    state = reranker.app.state.poolserve  # type: ignore[attr-defined]
    assert state.media_budgets.patches.held == 0  # given back once sent


def test_score_pairs_n_to_n(reranker: TestClient, reference: Reference) -> None:
    """text_1/text_2 of two queries and two documents: each query with its own document."""
    queries = ["w12 w13", "w14"]
    body = {"model": NAME, "text_1": queries, "text_2": {"content": PARTS[1:3]}}
    answer = _ok(reranker.post("/v1/score", json=body))
    for item, query, document in zip(answer["data"], queries, DOCUMENTS[1:3], strict=True):
        _close(item["score"], _expected(reference, query, document))


def test_rerank_top_n_and_documents(reranker: TestClient, reference: Reference) -> None:
    """/v1/rerank: the best top_n first, each returned document its content part."""
    want = [_expected(reference, QUERY, document) for document in DOCUMENTS]
    body = {
        "model": NAME,
        "query": QUERY,
        "documents": {"content": PARTS},
        "top_n": 3,
        "return_documents": True,
    }
    results = _ok(reranker.post("/v1/rerank", json=body))["results"]
    assert [r["index"] for r in results] == list(np.argsort(-np.asarray(want), kind="stable"))[:3]
    for result in results:
        _close(result["relevance_score"], want[result["index"]])
        part = PARTS[result["index"]]
        text = part["type"] == "text"
        assert result["document"] == ({"text": part["text"]} if text else {"multi_modal": part})
    body = {"model": NAME, "query": QUERY, "documents": {"content": PARTS[:2]}}
    results = _ok(reranker.post("/v1/rerank", json=body | {"return_documents": False}))["results"]
    assert all("document" not in r for r in results) and len(results) == 2


@pytest.mark.parametrize("indices", [(0, 1), (0, 2)])
def test_instruction_and_every_rerank_route(
    reranker: TestClient, reference: Reference, indices: tuple[int, ...]
) -> None:
    """vLLM's instruction fills the template's slot; /rerank (vLLM's body) and /v2/rerank
    (Cohere's document cap, which never cuts an image) score the same pairs, images alone
    too."""
    body = {
        "model": NAME,
        "query": QUERY,
        "documents": {"content": [PARTS[i] for i in indices]},
        "instruction": "w15 w16",
    }
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        results = _ok(reranker.post(path, json=body))["results"]
        for result in results:
            document = DOCUMENTS[indices[result["index"]]]
            want = _expected(reference, QUERY, document, instruction="w15 w16")
            _close(result["relevance_score"], want)


def _refused(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


def test_what_a_client_gets_wrong_is_a_400(reranker: TestClient, reference: Reference) -> None:
    """Too many images, a broken image, a text writing the placeholder, an image prompt longer
    than the truncation asked: 400s naming the input, the patch budget given back."""
    rerank = {"model": NAME, "query": QUERY}
    too_many = {"content": [PARTS[0]] * 6}
    error = _refused(reranker, "/v1/rerank", rerank | {"documents": too_many})
    assert "--max-images-per-request" in error["message"]
    assert error["param"] == "documents.content"
    broken = {"content": [PARTS[1], BROKEN]}
    error = _refused(reranker, "/v1/rerank", rerank | {"documents": broken})
    assert error["param"] == "documents.content[1]"
    typed = {"content": [PARTS[0], {"type": "text", "text": f"w1 {IMAGE_TEXT}"}]}
    error = _refused(reranker, "/score", {"model": NAME, "text_1": QUERY, "text_2": typed})
    assert error["param"] == "text_2.content[1]" and "image placeholders" in error["message"]
    keep = _num_tokens(reference, QUERY, 2) - 1  # the largest image's prompt, one token less
    cut = {"documents": {"content": [PARTS[0], PARTS[4]]}, "truncate_prompt_tokens": keep}
    error = _refused(reranker, "/v1/rerank", rerank | cut)
    assert "never cuts images" in error["message"] and error["param"] == "documents.content[1]"
    state = reranker.app.state.poolserve  # type: ignore[attr-defined]
    assert state.media_budgets.patches.held == 0


def test_the_card_carries_the_image_text(reranker: TestClient) -> None:
    """The image text is the checkpoint's vision start, placeholder and vision end tokens."""
    state = reranker.app.state.poolserve  # type: ignore[attr-defined]
    inline = state.find(NAME).handle.card.inline_images
    assert inline is not None and inline.placeholder == IMAGE_TEXT


def test_a_reranker_without_a_score_template_is_told_so(directory: Path) -> None:
    """Read as a reranker but served without --score-template: an image document is a 400
    that names the flag."""
    with _client(directory, hf_overrides=json.dumps(OVERRIDES)) as client:
        body = {"model": NAME, "query": QUERY, "documents": {"content": PARTS[:2]}}
        error = _refused(client, "/v1/rerank", body)
        assert "--score-template" in error["message"] and error["param"] == "documents"
        texts = {"model": NAME, "query": QUERY, "documents": ["w6 w7"]}
        assert client.post("/v1/rerank", json=texts).status_code == 200


def test_a_text_only_reranker_refuses_images(tmp_path: Path) -> None:
    ce = save_cross_encoder("bert_cls", tmp_path / "ce")
    settings = ServerSettings(model=str(ce), served_model_name="ce", max_model_len=64)
    with TestClient(create_app(settings)) as client:
        body = {"query": "w1", "documents": {"content": PARTS[:2]}}
        error = _refused(client, "/v1/rerank", body)
        assert "takes no images" in error["message"] and error["param"] == "documents.content"


def _unit(row: np.ndarray) -> np.ndarray:
    return row / np.linalg.norm(row)


def test_an_embedder_compares_embeddings(directory: Path, reference: Reference) -> None:
    """The checkpoint served as an embedder (gme, Qwen3-VL-Embedding): each document against
    the query by the cosine of their last-token states, a text as a text and an image as a
    one-message conversation of it (as it embeds on /v1/embeddings)."""
    conversation = reference.render([{"role": "user", "content": [{"type": "image"}]}])
    query = _unit(reference.last_hidden(QUERY).numpy())
    want = []
    for document in DOCUMENTS[:3]:
        if isinstance(document, str):
            row = reference.last_hidden(document)
        else:
            row = reference.last_hidden(conversation, [PICTURES[document]])
        want.append(float(_unit(row.numpy()) @ query))
    with _client(directory) as client:
        body = {"model": NAME, "queries": QUERY, "documents": {"content": PARTS[:3]}}
        answer = _ok(client.post("/score", json=body))
        for item, expected in zip(answer["data"], want, strict=True):
            _close(item["score"], expected)
        rerank = {"model": NAME, "query": QUERY, "documents": {"content": PARTS[:3]}}
        results = _ok(client.post("/v1/rerank", json=rerank))["results"]
        assert [r["index"] for r in results] == list(np.argsort(-np.asarray(want), kind="stable"))


@pytest.mark.slow
def test_a_real_server_reranks_images(
    directory: Path, template_file: Path, reference: Reference
) -> None:
    """`poolserve serve` with vLLM's flags (`--hf-overrides`, `--score-template`) and a small
    token budget: concurrent reranks of texts and images equal transformers."""
    import httpx

    from tests.http.test_server_process import free_port, start_server

    port = free_port()
    flags = ("--hf-overrides", json.dumps(OVERRIDES), "--score-template", str(template_file))
    budget = ("--max-num-batched-tokens", "16")
    process = start_server(
        port, "--model", str(directory), "--served-model-name", NAME, *flags, *budget
    )
    try:
        queries = [QUERY, "w17 w18", "w19"]

        def rerank(query: str) -> list[dict[str, Any]]:
            body = {"model": NAME, "query": query, "documents": {"content": PARTS}}
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/rerank", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            results: list[dict[str, Any]] = reply.json()["results"]
            return results

        with ThreadPoolExecutor(len(queries)) as pool:
            answers = list(pool.map(rerank, queries))
        for query, results in zip(queries, answers, strict=True):
            assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
            for result in results:
                want = _expected(reference, query, DOCUMENTS[result["index"]])
                _close(result["relevance_score"], want)
    finally:
        process.terminate()
        process.wait(30)
