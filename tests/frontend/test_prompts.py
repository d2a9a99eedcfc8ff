"""sentence-transformers prompts and Matryoshka sizes, compared with SentenceTransformer.encode."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from poolserve.config.settings import ServerSettings
from poolserve.http.app import create_app
from tests.tiny_models import write_st_modules

PROMPTS = {"query": "query: ", "passage": "passage: ", "empty": ""}
TEXTS = ["what is the capital of france", "paris is the capital of france"]


def _checkpoint(source: Path, directory: Path, **config: Any) -> Path:
    """A tiny BERT saved as sentence-transformers would, with config_sentence_transformers.json."""
    shutil.copytree(source, directory)
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    (directory / "config_sentence_transformers.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def prompted_dir(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return _checkpoint(
        tiny_model_dir("bert"),
        tmp_path_factory.mktemp("st") / "prompted",
        prompts=PROMPTS,
        default_prompt_name="query",
        similarity_fn_name="dot",
    )


@pytest.fixture(scope="module")
def reference(prompted_dir: Path) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(prompted_dir), device="cpu")


@contextmanager
def _client(directory: Path, **settings: Any) -> Iterator[TestClient]:
    with TestClient(create_app(ServerSettings(model=str(directory), **settings))) as client:
        yield client


@pytest.fixture(scope="module")
def client(prompted_dir: Path) -> Iterator[TestClient]:
    with _client(prompted_dir) as started:
        yield started


def _close(got: object, want: np.ndarray) -> None:
    arr = np.asarray(got, dtype=np.float32)
    assert arr.shape == want.shape, (arr.shape, want.shape)
    assert float(np.abs(arr - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1e-6)


def _openai(client: TestClient, **fields: Any) -> list[list[float]]:
    response = client.post("/v1/embeddings", json={"input": TEXTS, **fields})
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


def test_prompt_name_equals_sentence_transformers(client: TestClient, reference: Any) -> None:
    for name in PROMPTS:
        want = reference.encode(TEXTS, prompt_name=name)
        _close(_openai(client, prompt_name=name), want)
        tei = client.post("/embed", json={"inputs": TEXTS, "prompt_name": name})
        assert tei.status_code == 200, tei.text
        _close(tei.json(), want)
        pooling = client.post("/v1/pooling", json={"input": TEXTS, "prompt_name": name})
        _close([item["data"] for item in pooling.json()["data"]], want)


def test_cohere_input_type_selects_the_query_or_document_prompt(
    client: TestClient, reference: Any
) -> None:
    # search_query -> "query", search_document -> "passage"
    for input_type, name in (("search_query", "query"), ("search_document", "passage")):
        response = client.post("/v2/embed", json={"texts": TEXTS, "input_type": input_type})
        assert response.status_code == 200, response.text
        _close(response.json()["embeddings"]["float"], reference.encode(TEXTS, prompt_name=name))
    # no prompt for clustering: a 400 naming the model's prompts, never its default (query)
    response = client.post("/v2/embed", json={"texts": TEXTS, "input_type": "clustering"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "input_type" and "empty, passage, query" in error["message"], error


@pytest.mark.parametrize(
    ("input_type", "name"), [("query", "query"), ("document", "passage"), ("passage", "passage")]
)
def test_voyage_and_nim_input_type_selects_the_prompt(
    client: TestClient, reference: Any, input_type: str, name: str
) -> None:
    # Voyage says query/document, NIM query/passage, both on /v1/embeddings
    _close(_openai(client, input_type=input_type), reference.encode(TEXTS, prompt_name=name))


def test_nim_model_suffix_says_the_input_type(client: TestClient, reference: Any) -> None:
    # NIM's OpenAI-compatible form: "-query" or "-passage" on the model's name
    name = client.get("/v1/models").json()["data"][0]["id"]
    for suffix, prompt_name in (("-query", "query"), ("-passage", "passage")):
        answer = client.post("/v1/embeddings", json={"input": TEXTS, "model": name + suffix})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name
        embeddings = [item["embedding"] for item in answer.json()["data"]]
        _close(embeddings, reference.encode(TEXTS, prompt_name=prompt_name))
    body = {"input": TEXTS, "model": name + "-query", "input_type": "passage"}
    refused = client.post("/v1/embeddings", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
    unknown = client.post("/v1/embeddings", json={"input": TEXTS, "model": name + "-doc"})
    assert unknown.status_code == 404


def test_input_type_and_a_prompt_of_its_own_are_refused_together(client: TestClient) -> None:
    for fields in ({"prompt_name": "query"}, {"prompt": "x: "}):
        body = {"input": TEXTS, "input_type": "query", **fields}
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "input_type"


def test_tei_tokenize_with_a_prompt(client: TestClient, reference: Any) -> None:
    got = client.post("/tokenize", json={"inputs": TEXTS[0], "prompt_name": "passage"}).json()
    want = reference.tokenizer("passage: " + TEXTS[0])["input_ids"]
    assert [token["id"] for token in got[0]] == want
    # offsets index the prompted text, as TEI reports them
    first = next(token for token in got[0] if not token["special"])
    assert first["start"] == 0 and first["text"] == "passage"


def test_default_prompt_and_literal_prompt(client: TestClient, reference: Any) -> None:
    # the config's default_prompt_name applies when a request names none, as in encode()
    default = reference.encode(TEXTS)
    _close(default, reference.encode(TEXTS, prompt_name="query"))
    _close(_openai(client), default)
    _close(
        _openai(client, prompt="custom prefix: "), reference.encode(TEXTS, prompt="custom prefix: ")
    )
    # a literal prompt wins over a prompt name, as encode() does (with a warning)
    _close(
        _openai(client, prompt="x: ", prompt_name="passage"),
        reference.encode(TEXTS, prompt="x: "),
    )


def test_bad_prompt_requests_are_refused(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json={"input": TEXTS, "prompt_name": "nope"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_name"
    assert "passage" in response.json()["error"]["message"]
    ids = client.post("/v1/embeddings", json={"input": [101, 2054, 102], "prompt_name": "query"})
    assert ids.status_code == 400
    # token ids take no default prompt: they are the prompt already
    assert client.post("/v1/embeddings", json={"input": [101, 2054, 102]}).status_code == 200


def test_info_reports_the_sentence_transformers_config(client: TestClient) -> None:
    info = client.get("/info").json()
    assert info["prompts"] == PROMPTS
    assert info["default_prompt_name"] == "query"
    assert info["similarity_fn_name"] == "dot"


def test_default_prompt_name_flag(prompted_dir: Path, reference: Any) -> None:
    with _client(prompted_dir, default_prompt_name="passage") as client:
        _close(_openai(client), reference.encode(TEXTS, prompt_name="passage"))
        assert client.get("/info").json()["default_prompt_name"] == "passage"
    with (
        pytest.raises(ValueError, match="--default-prompt-name"),
        _client(prompted_dir, default_prompt_name="nope"),
    ):
        pass


@pytest.mark.parametrize("mode", ["pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_include_prompt_false_pools_past_the_prompt(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path, mode: str
) -> None:
    from sentence_transformers import SentenceTransformer

    directory = _checkpoint(tiny_model_dir("bert"), tmp_path / "excl", prompts=PROMPTS)
    pooling = {"word_embedding_dimension": 64, mode: True, "include_prompt": False}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    st = SentenceTransformer(str(directory), device="cpu")
    assert st[1].include_prompt is False
    with _client(directory) as client:
        for name in ("query", "empty"):
            want = st.encode(TEXTS, prompt_name=name)
            _close(_openai(client, prompt_name=name), want)
        literal = st.encode(TEXTS, prompt="a longer literal prompt: ")
        _close(_openai(client, prompt="a longer literal prompt: "), literal)
        # the prompt's tokens are left out: the answer differs from pooling them
        assert not np.allclose(literal, st.encode(["a longer literal prompt: " + t for t in TEXTS]))


def test_include_prompt_false_without_special_tokens_keeps_the_first_text_token(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    """Without special tokens no CLS leads the prompt: only the prompt's own tokens are skipped."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    directory = _checkpoint(tiny_model_dir("bert"), tmp_path / "nospecials", prompts=PROMPTS)
    pooling = {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}
    (directory / "1_Pooling" / "config.json").write_text(
        json.dumps({**pooling, "include_prompt": False})
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModel.from_pretrained(directory).eval()
    prompt = PROMPTS["query"]
    skipped = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    want = []
    for text in TEXTS:
        ids = tokenizer(prompt + text, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [tokens, 64]
        mean = hidden[skipped:].mean(0).numpy()
        want.append(mean / np.linalg.norm(mean))
    with _client(directory) as client:
        got = np.asarray(_openai(client, prompt_name="query", add_special_tokens=False))
    _close(got / np.linalg.norm(got, axis=1, keepdims=True), np.stack(want))


def test_truncate_dim_allows_dimensions_as_sentence_transformers(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    directory = _checkpoint(tiny_model_dir("bert"), tmp_path / "mrl", truncate_dim=32)
    for size in (16, 32):
        want = SentenceTransformer(str(directory), device="cpu", truncate_dim=size).encode(
            TEXTS, normalize_embeddings=True
        )
        with _client(directory) as client:
            _close(_openai(client, dimensions=size), want)
            _close(client.post("/embed", json={"inputs": TEXTS, "dimensions": size}).json(), want)
            assert client.get("/info").json()["truncate_dim"] == 32


def test_matryoshka_dimensions_flag(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    directory = _checkpoint(tiny_model_dir("bert"), tmp_path / "plain")
    with _client(directory) as client:
        refused = client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 16})
        assert refused.status_code == 400
    want = SentenceTransformer(str(directory), device="cpu", truncate_dim=16).encode(
        TEXTS, normalize_embeddings=True
    )
    with _client(directory, matryoshka_dimensions="32,16") as client:
        _close(_openai(client, dimensions=16), want)
        assert (
            client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 24}).status_code
            == 400
        )
        assert client.get("/info").json()["matryoshka_dimensions"] == [32, 16]


def test_a_literal_prompt_is_bounded_before_it_is_copied(client: TestClient) -> None:
    """A long `prompt` on many inputs would multiply the body: refused before any copy."""
    limits = client.app.state.poolserve.model.limits  # type: ignore[attr-defined]
    long_prompt = "p" * (limits.max_input_chars + 1)
    too_long = client.post("/v1/embeddings", json={"input": TEXTS, "prompt": long_prompt})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["param"] == "prompt"
    many = limits.max_request_chars // limits.max_input_chars + 1
    body = {"input": ["x"] * many, "prompt": "p" * limits.max_input_chars}
    amplified = client.post("/v1/embeddings", json=body)
    assert amplified.status_code == 413, amplified.text
    assert amplified.json()["error"]["param"] == "prompt"
