"""ColQwen2 (transformers' ColQwen2ForRetrieval) through the engine equals transformers: every
token's projection (its bias kept), L2-normalized, for queries (texts in the processor's query
form) and image documents (the processor's visual prompt, the image's rows in place of its
placeholders, positions sequential as transformers runs the model); queries and documents in
one step, whole and chunked, async scheduling on and off, and with the prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from poolserve.engine.loop import Engine
from poolserve.engine.vision_rows import RequestImages
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.params import PoolingParams
from poolserve.types.scoring import maxsim_score
from poolserve.types.tasks import HeadKind, PoolingTask
from poolserve.types.vision import PromptImages
from tests.engine.test_engine import CPU, _config
from tests.tiny_vl import ColQwenReference, image, save_tiny_colqwen2

TOKEN_EMBED = PoolingParams(task=PoolingTask.TOKEN_EMBED)
QUERIES = ("w1 w2 w3", "w4 the image. w5")
SIZES = ((60, 40), (33, 90), (120, 120))
CHUNKINGS: dict[str, dict[str, object]] = {
    "whole": {"max_num_batched_tokens": 512},
    "chunked": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 5},
}


class Retriever:
    """One tiny checkpoint, loaded, with its reference."""

    def __init__(self, directory: Path) -> None:
        self.loaded: LoadedModel = load_model(str(directory), device=CPU)
        self.reference = ColQwenReference(directory)

    def query(self, text: str) -> tuple[np.ndarray, torch.Tensor]:
        """Our ids of the query's form (equal to the processor's) and its reference."""
        forms = self.loaded.inline_images.retrieval  # type: ignore[union-attr]
        assert forms is not None
        ids = self.loaded.tokenizer(forms.query(text))["input_ids"]
        theirs, embeddings = self.reference.query(text)
        assert ids == theirs
        return np.asarray(ids), embeddings

    def document(self, seed: int) -> tuple[np.ndarray, PromptImages, torch.Tensor]:
        """The processor's ids of an image document, its patches and its reference."""
        ids, embeddings, media = self.reference.document(image(*SIZES[seed % 3], seed=seed))
        return np.asarray(ids), PromptImages((media["patches"],), (media["grid"],)), embeddings


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def retriever(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Retriever:
    return Retriever(save_tiny_colqwen2(tmp_path_factory.mktemp(request.param), request.param))


def _outputs(
    loaded: LoadedModel,
    prompts: Sequence[np.ndarray],
    media: Sequence[PromptImages | None],
    **config: object,
) -> list[np.ndarray]:
    """Every prompt submitted together; their outputs in order."""

    async def run() -> list[np.ndarray]:
        engine = Engine(loaded, _config(**config), CPU)
        engine.start()
        try:
            futures = engine.submit_many(list(prompts), TOKEN_EMBED, media=list(media))
            return [o.data for o in await asyncio.gather(*futures)]
        finally:
            await engine.stop()

    return asyncio.run(run())


def _assert_close(ours: np.ndarray, theirs: torch.Tensor) -> None:
    expected = theirs.float().numpy()
    assert ours.shape == expected.shape
    assert float(np.abs(ours - expected).max()) <= 1e-4 * float(np.abs(expected).max())


def test_the_checkpoint_loads_as_a_late_interaction_retriever(retriever: Retriever) -> None:
    loaded = retriever.loaded
    assert loaded.spec.head_kind is HeadKind.LATE_INTERACTION
    assert isinstance(loaded.head, torch.nn.Linear) and loaded.head.bias is not None
    inline = loaded.inline_images
    assert inline is not None and not inline.mrope and inline.retrieval is not None
    # sequential positions for a prompt with an image: each token's index on all three rows
    ids, media, _ = retriever.document(0)
    positions = RequestImages(media, ids, inline).positions
    assert np.array_equal(positions, np.broadcast_to(np.arange(len(ids)), (3, len(ids))))


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_queries_and_documents_equal_transformers(
    retriever: Retriever, chunking: str, async_scheduling: bool
) -> None:
    """Two queries (texts) and three image documents in one submission: every token's vector
    equals transformers', and so does each pair's MaxSim (score_retrieval, unpadded)."""
    queries = [retriever.query(text) for text in QUERIES]
    documents = [retriever.document(seed) for seed in range(3)]
    outputs = _outputs(
        retriever.loaded,
        [ids for ids, _ in queries] + [ids for ids, _, _ in documents],
        [None] * len(queries) + [media for _, media, _ in documents],
        async_scheduling=async_scheduling,
        **CHUNKINGS[chunking],
    )
    expected = [e for _, e in queries] + [e for _, _, e in documents]
    for ours, theirs in zip(outputs, expected, strict=True):
        _assert_close(ours, theirs)
    for q in range(len(queries)):
        for d in range(len(documents)):
            ours_score = maxsim_score(outputs[q], outputs[len(queries) + d])
            theirs_score = retriever.reference.maxsim(queries[q][1], documents[d][2])
            assert abs(ours_score - theirs_score) <= 1e-4 * abs(theirs_score)


def test_documents_after_cached_blocks_equal_transformers(retriever: Retriever) -> None:
    """Token outputs read every position, so they never take cached blocks (they only give
    theirs, keyed by the image's digest): the same document again, and another image with the
    same ids, each equal their own reference on one engine with the prefix cache on."""
    first_ids, first, first_ref = retriever.document(0)
    other_ids, other, other_ref = retriever.document(3)  # the same size, other pixels
    assert np.array_equal(first_ids, other_ids)
    engine = Engine(retriever.loaded, _config(block_size=4), CPU)

    async def run() -> list[np.ndarray]:
        engine.start()
        try:
            found: list[np.ndarray] = []
            for ids, media in ((first_ids, first), (first_ids, first), (other_ids, other)):
                (future,) = engine.submit_many([ids], TOKEN_EMBED, media=[media])
                found.append((await future).data)
            return found
        finally:
            await engine.stop()

    outputs = asyncio.run(run())
    _assert_close(outputs[0], first_ref)
    _assert_close(outputs[1], first_ref)
    _assert_close(outputs[2], other_ref)
    assert not np.allclose(outputs[0], outputs[2])
    assert engine.snapshot().prefix_cache_hit_tokens == 0
