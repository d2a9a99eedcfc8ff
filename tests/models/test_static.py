"""Static embeddings: model2vec and sentence-transformers StaticEmbedding outputs equal their
libraries' encode() through the offline engine (batched), and unsupported variants are refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from poolserve.models import ModelLoadError, load_model
from poolserve.models.static import StaticModel
from poolserve.offline import PoolingEngine
from poolserve.types.errors import UnsupportedQuantizationError
from tests.tiny_static import (
    TEXTS,
    exact_model2vec,
    random_table,
    save_model2vec,
    save_static_embedding,
)

CPU = torch.device("cpu")
# Against the exact mean (model2vec in float64, tests/tiny_static.py), relative to the scale:
# the engine sums in float64 and rounds the mean once to float32, so the worst difference
# measured on these texts (the 512-token one included) is 6e-8 (9e-8 against
# sentence-transformers, whose own EmbeddingBag sums in float32); float32 sums were 1.2e-6 off.
TOLERANCE = 1e-6


def _close(got: np.ndarray, want: np.ndarray) -> float:
    """The max abs difference, asserted within TOLERANCE of the reference's scale."""
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = float(np.abs(got - want).max())
    assert diff <= TOLERANCE * max(1.0, float(np.abs(want).max())), diff
    return diff


@pytest.fixture(scope="module")
def model2vec_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model2vec(tmp_path_factory.mktemp("m2v"), normalize=True)


@pytest.fixture(scope="module")
def m2v_engine(model2vec_dir: Path) -> Iterator[PoolingEngine]:
    with PoolingEngine(str(model2vec_dir), max_num_seqs=4) as engine:
        yield engine


@pytest.mark.parametrize("normalize", [True, False])
def test_model2vec_equals_encode(
    m2v_engine: PoolingEngine, model2vec_dir: Path, normalize: bool
) -> None:
    reference = exact_model2vec(model2vec_dir)
    texts = list(TEXTS) * 3  # more prompts than max_num_seqs: several steps, mixed batches
    got = m2v_engine.embed_array(texts, normalize=normalize)
    _close(got, reference.encode(texts, normalize=normalize))


def test_unknown_only_text_is_zero(m2v_engine: PoolingEngine) -> None:
    # model2vec drops [UNK]: a text of unknown tokens only has no tokens left, a zero vector
    assert not m2v_engine.embed_array(["\U0001f916 \U0001f916"], normalize=False).any()


def test_model2vec_cuts_at_max_length(tmp_path: Path) -> None:
    directory = save_model2vec(tmp_path, normalize=False, max_length=16)
    texts = ["a b c d e f g h i j k l m n o p q r s t u v w x y z", "x y \U0001f916 " * 10]
    with PoolingEngine(str(directory)) as engine:
        got = engine.embed_array(texts, normalize=False)
    _close(got, exact_model2vec(directory).encode(texts))


def test_vocabulary_quantized_and_int8(tmp_path: Path) -> None:
    from model2vec import StaticModel as Reference
    from model2vec.model import quantize_model

    vocab = 30522
    rng = np.random.default_rng(1)
    options = {
        "num_rows": 64,
        "token_mapping": rng.integers(0, 64, vocab),
        "weights": rng.uniform(0.1, 2.0, vocab).astype(np.float32),
    }
    clustered = save_model2vec(tmp_path / "clustered", **options)
    int8 = tmp_path / "int8"
    quantize_model(Reference.from_pretrained(clustered), quantize_to="int8").save_pretrained(int8)
    for directory in (clustered, int8):
        with PoolingEngine(str(directory)) as engine:
            got = engine.embed_array(list(TEXTS), normalize=False)
        _close(got, exact_model2vec(directory).encode(list(TEXTS)))


@pytest.mark.parametrize("normalize", [True, False])
def test_static_embedding_equals_sentence_transformers(tmp_path: Path, normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    directory = save_static_embedding(tmp_path, normalize=normalize)
    reference = SentenceTransformer(str(directory), device="cpu")
    texts = list(TEXTS)
    with PoolingEngine(str(directory)) as engine:
        got = engine.embed_array(texts, normalize=normalize)
    _close(got, reference.encode(texts, convert_to_numpy=True))


def test_loaded_shape(model2vec_dir: Path) -> None:
    loaded = load_model(str(model2vec_dir), device=CPU)
    assert isinstance(loaded.model, StaticModel)
    assert (loaded.spec.architecture, loaded.spec.max_model_len) == ("StaticModel", 512)
    assert loaded.sentence_transformers is not None
    assert loaded.sentence_transformers.pooling_mode == "mean"
    # no special tokens around a text: the ids are model2vec's own
    assert loaded.tokenizer("hello world")["input_ids"] == [7592, 2088]


def test_refuses_a_classifier_pipeline(model2vec_dir: Path, tmp_path: Path) -> None:
    directory = save_model2vec(tmp_path)
    (directory / "pipeline.skops").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"pipeline\.skops: a model2vec classifier pipeline"):
        load_model(str(directory), device=CPU)


def test_refuses_an_unsupported_table(tmp_path: Path) -> None:
    directory = save_model2vec(tmp_path)
    table = (random_table(30522) * 10).astype(np.uint8)
    save_file({"embeddings": table}, str(directory / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"dtype uint8 and shape .* is not supported"):
        load_model(str(directory), device=CPU)


def test_refuses_quantization_and_pickles(tmp_path: Path) -> None:
    directory = save_model2vec(tmp_path)
    with pytest.raises(UnsupportedQuantizationError, match="no projections"):
        load_model(str(directory), device=CPU, quantization="int8")
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")
    config = json.loads((directory / "config.json").read_text())
    assert "architectures" not in config
    with pytest.raises(Exception, match="only pickle weights"):
        load_model(str(directory), device=CPU)
