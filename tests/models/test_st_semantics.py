"""sentence-transformers semantics: max_seq_length truncation, do_lower_case, Dense placement."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from poolserve.models import ModelLoadError, load_model
from poolserve.models.sentence_transformers import read_sentence_transformers
from tests.tiny_models import write_st_modules

CPU = torch.device("cpu")
# Everyday words: texts of them take about one token a word with MiniLM's WordPiece.
VOCABULARY = (
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "or has had not but first one their its new after who they have two been other when time "
    "during there into school more may years over only year most city would world where later "
    "up such used many can state all about national people then some under known between"
)


@contextmanager
def _client(**settings: Any) -> Iterator[Any]:
    """A started app; imported here so the GPU check runs where the HTTP service is absent."""
    from starlette.testclient import TestClient

    from poolserve.config.settings import ServerSettings
    from poolserve.http.app import create_app

    with TestClient(create_app(ServerSettings(**settings))) as client:
        yield client


def _embeddings(client: Any, texts: list[str]) -> np.ndarray:
    response = client.post("/v1/embeddings", json={"input": texts})
    assert response.status_code == 200, response.text
    return np.asarray([item["embedding"] for item in response.json()["data"]], dtype=np.float32)


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    """float32 tolerance relative to the reference's scale (as tests/http/serving.py)."""
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= 1e-4 * max(float(np.abs(want).max()), 1e-6)


def _texts(num_tokens: list[int], tokens: Callable[[str], int], seed: int = 0) -> list[str]:
    """Random sentences with about the given numbers of tokens each."""
    rng = random.Random(seed)
    vocabulary = VOCABULARY.split()
    texts = []
    for target in num_tokens:
        words = [rng.choice(vocabulary)]
        while tokens(" ".join(words)) < target:
            words.append(rng.choice(vocabulary))
        texts.append(" ".join(words))
    return texts


def test_minilm_config_is_read(minilm_dir: Path) -> None:
    st = read_sentence_transformers(minilm_dir, CPU)
    assert st is not None and st.max_seq_length == 256 and st.do_lower_case is False


def test_minilm_truncates_like_sentence_transformers(minilm_dir: Path) -> None:
    from sentence_transformers import SentenceTransformer

    reference_model = SentenceTransformer(str(minilm_dir), device="cpu")
    tokenizer = reference_model.tokenizer

    def count(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    texts = [*_texts([300, 355, 420, 505], count), "a short one"]
    reference = reference_model.encode(texts, convert_to_numpy=True)
    with _client() as client:
        got = _embeddings(client, texts)
        usage = client.post("/v1/embeddings", json={"input": texts[:4]}).json()["usage"]
    _assert_close(got, reference)
    assert usage["prompt_tokens"] == 4 * 256


def _st_checkpoint(source: Path, target: Path, *, do_lower_case: bool) -> Path:
    directory = shutil.copytree(source, target)
    return write_st_modules(
        directory, max_seq_length=16, do_lower_case=do_lower_case, cased_tokenizer=True
    )


def test_do_lower_case_and_max_seq_length_match_sentence_transformers(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    lower = _st_checkpoint(tiny_model_dir("bert"), tmp_path / "lower", do_lower_case=True)
    cased = _st_checkpoint(tiny_model_dir("bert"), tmp_path / "cased", do_lower_case=False)
    texts = [
        "Hello World",
        "The QUICK Brown fox Jumps over The Lazy dog, Again And Again And Again Until Done",
    ]
    for directory in (lower, cased):
        reference = SentenceTransformer(str(directory), device="cpu").encode(texts)
        with _client(model=str(directory)) as client:
            _assert_close(_embeddings(client, texts), reference)
            tokens = [
                client.post("/tokenize", json={"prompt": p}).json()["tokens"]
                for p in ("Hello World", "hello world")
            ]
        assert (tokens[0] == tokens[1]) == (directory == lower)


def _write_dense(directory: Path) -> None:
    """modules.json with mean Pooling and a Dense 64 -> 8 layer."""
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    modules = json.loads((directory / "modules.json").read_text())
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    (directory / "modules.json").write_text(json.dumps([*modules, dense]))
    (directory / "3_Dense").mkdir()
    config = {"in_features": 64, "out_features": 8, "bias": True}
    (directory / "3_Dense" / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(5)
    weights = {
        "linear.weight": torch.randn(8, 64, generator=generator),
        "linear.bias": torch.randn(8, generator=generator),
    }
    save_file(weights, str(directory / "3_Dense" / "model.safetensors"))


def test_dense_is_placed_on_the_model_device(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    directory = shutil.copytree(tiny_model_dir("bert"), tmp_path / "dense")
    _write_dense(directory)
    st = read_sentence_transformers(directory, torch.device("meta"))
    assert st is not None and st.dense is not None and st.max_seq_length is None
    assert {p.device.type for p in st.dense.parameters()} == {"meta"}
    assert {p.dtype for p in st.dense.parameters()} == {torch.float32}


@pytest.mark.parametrize(
    "filename,config,expected",
    [
        ("sentence_roberta_config.json", {"max_seq_length": 128, "do_lower_case": True}, 128),
        ("sentence_bert_config.json", {"max_seq_length": 0}, ModelLoadError),
        ("sentence_bert_config.json", {"max_seq_length": True}, ModelLoadError),
        ("sentence_bert_config.json", {"max_seq_length": "long"}, ModelLoadError),
        ("sentence_bert_config.json", {"do_lower_case": False}, None),
    ],
)
def test_sentence_bert_config_variants(
    tiny_model_dir: Callable[[str], Path],
    tmp_path: Path,
    filename: str,
    config: dict[str, object],
    expected: object,
) -> None:
    directory = shutil.copytree(tiny_model_dir("bert"), tmp_path / "variant")
    write_st_modules(directory, max_seq_length=None, do_lower_case=False)
    (directory / "sentence_bert_config.json").unlink()
    (directory / filename).write_text(json.dumps(config))
    if expected is ModelLoadError:
        with pytest.raises(ModelLoadError, match="max_seq_length"):
            read_sentence_transformers(directory, CPU)
        return
    st = read_sentence_transformers(directory, CPU)
    assert st is not None and st.max_seq_length == expected
    assert st.do_lower_case is bool(config.get("do_lower_case"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_runs_on_cuda(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    directory = shutil.copytree(tiny_model_dir("bert"), tmp_path / "dense_cuda")
    _write_dense(directory)
    cuda = torch.device("cuda")
    loaded = load_model(str(directory), device=cuda)
    dense = loaded.sentence_transformers.dense if loaded.sentence_transformers else None
    assert dense is not None and {p.device.type for p in dense.parameters()} == {"cuda"}
    reference = read_sentence_transformers(directory, CPU)
    assert reference is not None and reference.dense is not None
    pooled = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))  # [batch, hidden]
    with torch.no_grad():
        got = dense(pooled.to(cuda)).cpu()  # [batch, 8]
        want = reference.dense(pooled)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
