"""ColPali (transformers' ColPaliForRetrieval) through the engine equals transformers: every token's
projection (its bias kept), L2-normalized, for queries (texts in the processor's query form,
its BOS written by the form) and image documents (the processor's `<image>` placeholders, then
its BOS and visual prompt; the SigLIP tower's projected patches in place of the placeholders),
the whole prompt attending both ways and positions counted from 1 as PaliGemma runs it;
queries and documents in one submission, in steps that mix them, async scheduling on and off.
The front end's patches equal the processor's pixel values; the attention pattern is the
reference's (a causal one would differ)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from poolserve.engine.loop import Engine
from poolserve.frontend.grid_images import grid_patches
from poolserve.frontend.prompt_images import expand
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.scoring import maxsim_score
from poolserve.types.tasks import HeadKind, PoolingTask
from poolserve.types.vision import PromptImages
from tests.engine.test_engine import CPU
from tests.tiny_vl import COLPALI_IMAGE, ColPaliReference, image, save_tiny_colpali

TOKEN_EMBED = PoolingParams(task=PoolingTask.TOKEN_EMBED)
QUERIES = ("ab cd", "What is x?")
SIZES = ((60, 40), (33, 90), (28, 28))


class Retriever:
    """One tiny checkpoint, loaded, with its reference."""

    def __init__(self, directory: Path) -> None:
        self.loaded: LoadedModel = load_model(str(directory), device=CPU)
        self.reference = ColPaliReference(directory)

    def query(self, text: str) -> tuple[np.ndarray, torch.Tensor]:
        """Our ids of the query's form (equal to the processor's) and its reference."""
        forms = self.loaded.inline_images.retrieval  # type: ignore[union-attr]
        assert forms is not None
        ids = self.loaded.tokenizer(forms.query(text))["input_ids"]
        theirs, embeddings = self.reference.query(text)
        assert ids == theirs
        return np.asarray(ids), embeddings

    def document(self, seed: int) -> tuple[np.ndarray, PromptImages, torch.Tensor]:
        """Our ids and patches of an image document (equal to the processor's) and its
        reference."""
        inline = self.loaded.inline_images
        assert inline is not None and inline.retrieval is not None
        picture = image(*SIZES[seed % 3], seed=seed)
        theirs, embeddings, pixels = self.reference.document(picture)
        patches, grid = grid_patches(picture, inline.processing)
        assert np.array_equal(patches, _patches_of(pixels.numpy(), inline.processing.patch_size))
        rendered = self.loaded.tokenizer(inline.retrieval.document, add_special_tokens=False)
        ids = expand(rendered["input_ids"], [grid], inline)
        assert ids == theirs
        return np.asarray(ids), PromptImages((patches,), (grid,)), embeddings


def _patches_of(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[3, H, W] pixel values as the tower's patches: row by row, each patch's values by
    channel, then row, then column (the patch embedding convolution's order)."""
    channels, height, width = pixels.shape
    grid = pixels.reshape(channels, height // patch, patch, width // patch, patch)
    return grid.transpose(1, 3, 0, 2, 4).reshape(-1, channels * patch * patch)


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    return Retriever(save_tiny_colpali(tmp_path_factory.mktemp("colpali")))


def _outputs(
    loaded: LoadedModel,
    prompts: Sequence[np.ndarray],
    media: Sequence[PromptImages | None],
    async_scheduling: bool,
) -> list[np.ndarray]:
    """Every prompt submitted together, each scheduled whole (bidirectional), at most two a
    step so queries and documents share steps; their outputs in order."""
    config = SchedulerConfig(
        max_num_batched_tokens=64,
        max_num_seqs=2,
        num_kv_blocks=64,
        enable_chunked_prefill=False,
        async_scheduling=async_scheduling,
    )

    async def run() -> list[np.ndarray]:
        engine = Engine(loaded, config, CPU)
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


def test_the_checkpoint_loads_as_a_bidirectional_late_interaction_retriever(
    retriever: Retriever,
) -> None:
    loaded = retriever.loaded
    assert loaded.spec.head_kind is HeadKind.LATE_INTERACTION
    assert not loaded.spec.is_causal  # scheduled whole, no KV cache, no prefix cache
    assert isinstance(loaded.head, torch.nn.Linear) and loaded.head.bias is not None
    inline = loaded.inline_images
    assert inline is not None and not inline.mrope and inline.vision_start_token_id is None
    assert inline.processing.resize_to == (COLPALI_IMAGE, COLPALI_IMAGE)
    forms = inline.retrieval
    assert forms is not None
    assert forms.query("q") == "<bos>Question: q" + "<pad>" * 10 + "\n"
    assert forms.document == "<image><bos>Describe the image.\n"
    # the processor turns the tokenizer's BOS off; so does the loader
    assert (
        loaded.tokenizer("ab")["input_ids"]
        == loaded.tokenizer("ab", add_special_tokens=False)["input_ids"]
    )


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_queries_and_documents_equal_transformers(
    retriever: Retriever, async_scheduling: bool
) -> None:
    """Two queries (texts) and three image documents in one submission: every token's vector
    equals transformers', and so does each pair's MaxSim (score_retrieval, unpadded)."""
    queries = [retriever.query(text) for text in QUERIES]
    documents = [retriever.document(seed) for seed in range(3)]
    prompts = [queries[0][0], documents[0][0], queries[1][0], documents[1][0], documents[2][0]]
    media = [None, documents[0][1], None, documents[1][1], documents[2][1]]
    outputs = _outputs(retriever.loaded, prompts, media, async_scheduling)
    expected = [queries[0][1], documents[0][2], queries[1][1], documents[1][2], documents[2][2]]
    for ours, theirs in zip(outputs, expected, strict=True):
        _assert_close(ours, theirs)
    found = {"q": [outputs[0], outputs[2]], "d": [outputs[1], outputs[3], outputs[4]]}
    for q, (_, query) in enumerate(queries):
        for d, (_, _, document) in enumerate(documents):
            ours_score = maxsim_score(found["q"][q], found["d"][d])
            theirs_score = retriever.reference.maxsim(query, document)
            assert abs(ours_score - theirs_score) <= 1e-4 * abs(theirs_score)


def test_the_reference_attends_both_ways(retriever: Retriever) -> None:
    """The reference itself, run by hand: its outputs are the prompt attending both ways (the
    mask its processor's token types make), not a causal decoder's."""
    reference = retriever.reference
    inputs = reference.processor.process_queries([QUERIES[0]])
    model = reference.model
    with torch.no_grad():
        want = model(**inputs).embeddings[0]
        ids = inputs["input_ids"]
        embeds = model.vlm.get_input_embeddings()(ids)
        positions = torch.arange(ids.shape[1])[None] + 1
        found = {}
        for name, causal in (("both", False), ("causal", True)):
            mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool)
            mask = mask.tril() if causal else mask
            hidden = model.vlm.language_model(
                inputs_embeds=embeds, attention_mask=mask[None, None], position_ids=positions
            ).last_hidden_state
            vectors = model.embedding_proj_layer(hidden)[0]
            found[name] = vectors / vectors.norm(dim=-1, keepdim=True)
    assert torch.allclose(found["both"], want, atol=1e-6)
    assert not torch.allclose(found["causal"], want, atol=1e-2)
