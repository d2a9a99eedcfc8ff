"""bge-m3: dense, sparse (lexical weights) and ColBERT outputs of one model equal FlagEmbedding's
BGEM3 encode() (rebuilt by hand in tests/tiny_m3.py), several texts batched together; its heads
are read as tensors only."""

from __future__ import annotations

import itertools
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from poolserve.models import ModelLoadError, load_model
from poolserve.models.bge_m3 import COLBERT_FILE, SPARSE_FILE, m3_unused_ids
from poolserve.offline import PoolingEngine
from poolserve.pooling.lexical import LexicalHead, LexicalPool
from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import build_pooler
from poolserve.types.errors import UnsupportedTaskError
from poolserve.types.model_info import M3_COLBERT, M3_SPARSE, PoolingModelInfo
from poolserve.types.outputs import unpack_parts
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import HeadKind, PoolingTask
from tests.tiny_m3 import COLBERT_DIM, HIDDEN, TEXTS, M3Reference, TinyM3, reference_encode
from tests.tiny_m3 import save_tiny_m3 as save

CPU = torch.device("cpu")
# float32 throughout; the packed forward and the padded batch differ by the order of their adds.
# Measured: dense 2e-7, ColBERT 3e-7, lexical weights 2e-6 on weights up to 6 (4e-7 relative).
TOLERANCE = 1e-5


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    assert float(np.abs(got - want).max(initial=0.0)) <= TOLERANCE * scale


def _lexical(data: np.ndarray) -> dict[str, float]:
    """A `[2, nnz]` sparse output as FlagEmbedding's lexical_weights dict (id string -> weight)."""
    return {str(int(i)): float(w) for i, w in zip(data[0], data[1], strict=True)}


@pytest.fixture(scope="module")
def m3(tmp_path_factory: pytest.TempPathFactory) -> TinyM3:
    return save(tmp_path_factory.mktemp("bge-m3"))


@pytest.fixture(scope="module")
def reference(m3: TinyM3) -> M3Reference:
    return reference_encode(m3, list(TEXTS))


@pytest.fixture(scope="module")
def engine(m3: TinyM3) -> Iterator[PoolingEngine]:
    # fewer sequences per step than texts: several steps, batches of mixed lengths
    with PoolingEngine(str(m3.path), max_num_seqs=4) as started:
        yield started


def test_detected_with_its_three_tasks(engine: PoolingEngine) -> None:
    assert engine.model.card.pooling_info.head_kind is HeadKind.BGE_M3
    assert set(engine.supported_tasks) == {
        PoolingTask.EMBED,
        PoolingTask.EMBED_SPARSE,
        PoolingTask.TOKEN_EMBED,
    }


def test_dense_equals_flagembedding(engine: PoolingEngine, reference: M3Reference) -> None:
    _close(engine.embed_array(list(TEXTS)), reference.dense_vecs)


def test_sparse_equals_lexical_weights(engine: PoolingEngine, reference: M3Reference) -> None:
    outputs = engine.encode(list(TEXTS), PoolingTask.EMBED_SPARSE)
    for output, want in zip(outputs, reference.lexical_weights, strict=True):
        got = _lexical(output.data)
        assert sorted(got) == sorted(want)  # the same ids: specials and zero weights dropped
        assert list(output.data[0]) == sorted(output.data[0])  # ascending ids
        keys = sorted(want)
        _close(np.array([got[k] for k in keys]), np.array([want[k] for k in keys]))


def test_sparse_drops_flagembeddings_unused_tokens(m3: TinyM3, engine: PoolingEngine) -> None:
    tokenizer = m3.tokenizer
    unused = m3_unused_ids(tokenizer)
    assert unused == {tokenizer.cls_token_id, tokenizer.eos_token_id, 1, tokenizer.unk_token_id}
    assert tokenizer.mask_token_id not in unused  # FlagEmbedding keeps <mask>
    for output in engine.encode(list(TEXTS), PoolingTask.EMBED_SPARSE):
        assert not set(output.data[0].astype(int).tolist()) & unused
        assert (output.data[1] > 0).all()


def test_colbert_equals_colbert_vecs(engine: PoolingEngine, reference: M3Reference) -> None:
    outputs = engine.encode(list(TEXTS), PoolingTask.TOKEN_EMBED)
    for output, want in zip(outputs, reference.colbert_vecs, strict=True):
        assert output.data.shape[1] == COLBERT_DIM
        assert output.data.shape[0] == output.prompt_tokens - 1  # every token but CLS
        _close(output.data, want)


def test_colbert_unnormalized(m3: TinyM3, engine: PoolingEngine) -> None:
    text = TEXTS[1]
    (output,) = engine.encode([text], PoolingTask.TOKEN_EMBED, normalize=False)
    ids = torch.tensor([m3.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        last = m3.backbone(input_ids=ids).last_hidden_state[0]  # [T, hidden]
        want = m3.colbert(last[1:]).numpy()
    _close(output.data, want)


def test_score_compares_dense_vectors(engine: PoolingEngine, reference: M3Reference) -> None:
    scores = engine.score(TEXTS[0], [TEXTS[1], TEXTS[3]])
    want = [float(reference.dense_vecs[0] @ reference.dense_vecs[i]) for i in (1, 3)]
    np.testing.assert_allclose(scores, want, atol=1e-5)


def test_lexical_pool_over_chunks_equals_whole() -> None:
    # encoders run whole prompts; the method still folds chunks as every method does
    torch.manual_seed(3)
    linear = torch.nn.Linear(HIDDEN, 1)
    hidden = torch.randn(12, HIDDEN)
    ids = [0, 7, 9, 7, 3, 9, 9, 11, 1, 7, 12, 2]
    excluded = frozenset({0, 1, 2, 3})

    def pooled(cuts: list[int]) -> torch.Tensor:
        method = LexicalPool(linear, excluded, async_scheduling=False, stats=CloneStats())
        bounds = [0, *cuts, len(ids)]
        out = None
        for start, end in itertools.pairwise(bounds):
            out = method.add_chunk(hidden[start:end], ids[start:end], end == len(ids))
        assert out is not None
        return LexicalHead()(out)

    whole = pooled([])
    weights = torch.relu(linear(hidden)).squeeze(-1).detach()
    want = {
        i: max(float(w) for w, t in zip(weights, ids, strict=True) if t == i)
        for i in set(ids) - excluded
    }
    want = {i: w for i, w in want.items() if w > 0}
    assert whole[0].int().tolist() == sorted(want)
    torch.testing.assert_close(whole[1], torch.tensor([want[i] for i in sorted(want)]))
    torch.testing.assert_close(pooled([1, 5, 6]), whole)


# token ids of one prompt: repeats, and the excluded ids 0-3 among them
M3_IDS = [0, 7, 9, 7, 3, 9, 9, 11, 1, 7, 12, 2]


def _m3_pooled(
    info: PoolingModelInfo, task: PoolingTask, hidden: torch.Tensor, cuts: list[int]
) -> torch.Tensor:
    """One request of `task` over the rows `hidden`, cut into chunks at `cuts`."""
    pooler = build_pooler(info, PoolingParams(task=task), async_scheduling=True, stats=CloneStats())
    bounds, out = [0, *cuts, len(M3_IDS)], None
    for start, end in itertools.pairwise(bounds):
        out = pooler.add_chunk(hidden[start:end], M3_IDS[start:end], end == len(M3_IDS))
    assert out is not None
    return out


def test_the_combined_task_packs_the_three_outputs_of_one_pass() -> None:
    torch.manual_seed(5)
    heads = torch.nn.ModuleDict(
        {M3_SPARSE: torch.nn.Linear(HIDDEN, 1), M3_COLBERT: torch.nn.Linear(HIDDEN, COLBERT_DIM)}
    )
    info = PoolingModelInfo(
        is_decoder=False,
        hidden_size=HIDDEN,
        m3_heads=heads,
        sparse_excluded_ids=frozenset(range(4)),
    )
    hidden = torch.randn(len(M3_IDS), HIDDEN)
    whole = unpack_parts(_m3_pooled(info, PoolingTask.EMBED_M3, hidden, []).numpy())
    # dense [1, D], lexical weights [2, nnz], ColBERT [T - 1, dim]: each its own task's output
    singles = [PoolingTask.EMBED, PoolingTask.EMBED_SPARSE, PoolingTask.TOKEN_EMBED]
    for part, task in zip(whole, singles, strict=True):
        single = _m3_pooled(info, task, hidden, []).numpy()
        np.testing.assert_array_equal(part, single.reshape(part.shape))
    chunked = unpack_parts(_m3_pooled(info, PoolingTask.EMBED_M3, hidden, [1, 5, 6]).numpy())
    for part, again in zip(whole, chunked, strict=True):
        np.testing.assert_allclose(again, part, rtol=1e-6, atol=1e-6)


def test_the_combined_task_is_not_a_clients(engine: PoolingEngine) -> None:
    # it exists for weights_for_different_modes on /rerank and /score (tests/http/api)
    with pytest.raises(UnsupportedTaskError, match="embed_m3"):
        engine.encode(["hello"], PoolingTask.EMBED_M3)


def test_one_head_file_alone_serves_dense_only(
    m3: TinyM3, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = shutil.copytree(m3.path, tmp_path / "m3")
    (directory / COLBERT_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(directory), device=CPU)
    assert loaded.spec.head_kind is HeadKind.NONE and loaded.head is None
    assert SPARSE_FILE in caplog.text


class _NotATensor:
    """An object torch.load(weights_only=True) must refuse to build."""


@pytest.mark.parametrize(
    "saved",
    [
        pytest.param(lambda: torch.nn.Linear(HIDDEN, 1), id="pickled-module"),
        pytest.param(lambda: {"weight": torch.zeros(1, HIDDEN), "bias": _NotATensor()}, id="obj"),
        pytest.param(lambda: {"weight": torch.zeros(1, HIDDEN), "bias": "0"}, id="string"),
        pytest.param(lambda: {"weight": torch.zeros(1, HIDDEN)}, id="no-bias"),
        pytest.param(lambda: {"weight": torch.zeros(2, HIDDEN), "bias": torch.zeros(2)}, id="2"),
    ],
)
def test_heads_are_tensors_only(m3: TinyM3, tmp_path: Path, saved: object) -> None:
    directory = shutil.copytree(m3.path, tmp_path / "m3")
    torch.save(saved(), directory / SPARSE_FILE)  # type: ignore[operator]
    with pytest.raises(ModelLoadError, match=SPARSE_FILE):
        load_model(str(directory), device=CPU)
