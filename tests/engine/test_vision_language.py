"""Vision-language embedders (Qwen2-VL, Qwen3-VL) through the engine equal transformers: each
prompt's images through the tower, their rows in place of the placeholders, M-RoPE positions,
Qwen3-VL's deepstack; alone and mixed with texts in one step, whole and chunked (an image split
across chunks), async scheduling on and off, and with the prefix cache (equal images share
blocks, different ones never do)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from poolserve.engine import vision_rows
from poolserve.engine.loop import Engine
from poolserve.engine.sched.queues import image_runs
from poolserve.engine.vision_rows import RequestImages
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import InvalidRequestError, LoraAdapterError
from poolserve.types.lora import LoraServing
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from poolserve.types.vision import PromptImages
from tests.engine.test_engine import CPU, _config
from tests.tiny_vl import FAMILIES, Reference, image, save_tiny_vl

EMBED = PoolingParams(task=PoolingTask.EMBED, normalize=False)  # the last token's state
TOKEN_EMBED = PoolingParams(task=PoolingTask.TOKEN_EMBED, normalize=False)
# Conversations by their parts: a string is a text part, an int the size index of an image.
SIZES = ((60, 40), (33, 90), (120, 120), (28, 28))
CONVERSATIONS: tuple[tuple[str | int, ...], ...] = (
    (0, "w1 w2 w3"),
    ("w4 w5", 1, "w6", 2),
    ("w7 w8 w9 w10",),
    (3,),
    (2, "w11", 0, "w12 w13"),
)
CHUNKINGS: dict[str, dict[str, object]] = {
    "whole": {"max_num_batched_tokens": 512},
    "chunked": {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 7},
}


# Qwen3-VL-Reranker as vLLM serves it: its LM head's "no" and "yes" rows, sigmoid(yes - no).
RERANKER = {
    "classifier_from_token": ["w1", "w2"],
    "is_original_qwen3_reranker": True,
}


class Family:
    """One tiny checkpoint, loaded, with its reference."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.loaded: LoadedModel = load_model(str(directory), device=CPU)
        self.reference = Reference(directory)

    def prompt(
        self, parts: Sequence[str | int], seed: int = 0
    ) -> tuple[str, list[Image.Image], np.ndarray, PromptImages | None]:
        """The rendered conversation, its images, its ids (placeholders expanded), its media."""
        images = [
            image(*SIZES[p], seed=seed + i) for i, p in enumerate(parts) if isinstance(p, int)
        ]
        content = [
            {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
        ]
        text = self.reference.render([{"role": "user", "content": content}])
        ids, extra = self.reference.inputs(text, images)
        if not images:
            return text, images, ids[0].numpy(), None
        grids = [tuple(int(v) for v in g) for g in extra["image_grid_thw"].tolist()]
        counts = [t * h * w for t, h, w in grids]
        split = np.split(extra["pixel_values"].float().numpy(), np.cumsum(counts)[:-1])
        media = PromptImages(tuple(split), tuple(grids))  # type: ignore[arg-type]
        return text, images, ids[0].numpy(), media


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    directory = save_tiny_vl(request.param, tmp_path_factory.mktemp(request.param))
    return Family(directory)


def _outputs(
    loaded: LoadedModel,
    prompts: Sequence[np.ndarray],
    media: Sequence[PromptImages | None],
    params: PoolingParams,
    **config: object,
) -> list[np.ndarray]:
    """Every prompt submitted together; their outputs in order."""

    async def run() -> list[np.ndarray]:
        engine = Engine(loaded, _config(**config), CPU)
        engine.start()
        try:
            futures = engine.submit_many(list(prompts), params, media=list(media))
            return [o.data for o in await asyncio.gather(*futures)]
        finally:
            await engine.stop()

    return asyncio.run(run())


def _assert_close(ours: np.ndarray, theirs: torch.Tensor) -> None:
    expected = theirs.float().numpy()
    scale = max(float(np.abs(expected).max()), 1e-6)
    assert ours.shape == expected.shape
    assert float(np.abs(ours - expected).max()) <= 1e-4 * scale


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunking", sorted(CHUNKINGS))
def test_embeddings_equal_transformers(
    family: Family, chunking: str, async_scheduling: bool
) -> None:
    built = [family.prompt(parts, seed=i) for i, parts in enumerate(CONVERSATIONS)]
    outputs = _outputs(
        family.loaded,
        [ids for _, _, ids, _ in built],
        [media for *_, media in built],
        EMBED,
        async_scheduling=async_scheduling,
        **CHUNKINGS[chunking],
    )
    for (text, images, _, _), ours in zip(built, outputs, strict=True):
        _assert_close(ours, family.reference.last_hidden(text, images))


def test_every_token_equals_transformers_chunked(family: Family) -> None:
    text, images, ids, media = family.prompt(("w1", 2, "w2 w3", 0), seed=3)
    (ours,) = _outputs(
        family.loaded,
        [ids],
        [media],
        TOKEN_EMBED,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
    )
    _assert_close(ours, family.reference.hidden(text, images))


def _waves(
    loaded: LoadedModel, waves: Sequence[Sequence[tuple[np.ndarray, PromptImages | None]]]
) -> tuple[list[np.ndarray], Engine]:
    """Each wave submitted once the one before has finished, on one engine (its cache kept)."""
    engine = Engine(loaded, _config(block_size=8), CPU)

    async def run() -> list[np.ndarray]:
        engine.start()
        try:
            found: list[np.ndarray] = []
            for wave in waves:
                prompts, media = [p for p, _ in wave], [m for _, m in wave]
                futures = engine.submit_many(prompts, EMBED, media=media)
                found += [o.data for o in await asyncio.gather(*futures)]
            return found
        finally:
            await engine.stop()

    return asyncio.run(run()), engine


def test_prefix_cache_shares_blocks_only_between_equal_images(family: Family) -> None:
    """The same conversation again hits its cached blocks, image included; the same text with
    another image hits only the blocks before its image, and equals its own reference."""
    parts = ("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10", 2, "w11 w12")
    first = family.prompt(parts, seed=0)
    other = family.prompt(parts, seed=7)  # equal ids, other pixels
    assert np.array_equal(first[2], other[2])
    placeholder = family.loaded.inline_images.image_token_id  # type: ignore[union-attr]
    start = int(np.flatnonzero(first[2] == placeholder)[0])
    outputs, engine = _waves(
        family.loaded,
        [[(first[2], first[3])], [(first[2], first[3])], [(other[2], other[3])]],
    )
    _assert_close(outputs[0], family.reference.last_hidden(first[0], first[1]))
    _assert_close(outputs[1], family.reference.last_hidden(first[0], first[1]))
    _assert_close(outputs[2], family.reference.last_hidden(other[0], other[1]))
    assert not np.allclose(outputs[0], outputs[2])
    length = len(first[2])
    again = (length - 1) // 8 * 8  # every full block but the last token's
    before_image = start // 8 * 8  # the blocks wholly before the first placeholder
    assert engine.snapshot().prefix_cache_hit_tokens == again + before_image


def test_placeholders_must_match_the_images(family: Family) -> None:
    """A placeholder run without its image, or of another length than its grid gives, is
    refused before admission."""
    _, _, ids, media = family.prompt(("w1", 0, "w2"))
    assert media is not None
    engine = Engine(family.loaded, _config(), CPU)

    async def refused(prompt: np.ndarray, given: PromptImages | None) -> str:
        with pytest.raises(InvalidRequestError) as caught:
            engine.submit_many([prompt], EMBED, media=[given])
        return str(caught.value)

    placeholder = family.loaded.inline_images.image_token_id  # type: ignore[union-attr]
    short = np.delete(ids, int(np.flatnonzero(ids == placeholder)[0]))  # one placeholder less
    assert "no image" in asyncio.run(refused(ids, None))
    assert "do not match" in asyncio.run(refused(short, media))


def test_reranker_reads_the_lm_head_rows(family: Family) -> None:
    """Qwen3-VL-Reranker's reading (vLLM's --hf-overrides): sigmoid of the "yes" row's logit
    minus the "no" row's, at the last token, images in the prompt."""
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
    prefix = name[family.reference.family]
    overrides = {**RERANKER, "architectures": [f"{prefix}ForSequenceClassification"]}
    loaded = load_model(str(family.directory), device=CPU, hf_overrides=overrides)
    built = [family.prompt(parts, seed=i) for i, parts in enumerate(CONVERSATIONS[:3])]
    scores = _outputs(
        loaded,
        [ids for _, _, ids, _ in built],
        [media for *_, media in built],
        PoolingParams(task=PoolingTask.SCORE),
        max_num_batched_tokens=16,
    )
    vocab = family.reference.tokenizer.convert_tokens_to_ids(RERANKER["classifier_from_token"])
    for (text, images, _, _), ours in zip(built, scores, strict=True):
        logits = family.reference.last_logits(text, images)
        expected = torch.sigmoid(logits[vocab[1]] - logits[vocab[0]]).reshape(1)
        _assert_close(ours, expected)


def test_lora_adapters_are_refused_at_load(family: Family) -> None:
    with pytest.raises(LoraAdapterError, match="not supported"):
        load_model(str(family.directory), device=CPU, lora=LoraServing())


@pytest.mark.parametrize(
    ("dtype", "quantization"), [(torch.bfloat16, None), (torch.float32, "int8")]
)
def test_other_precisions_stay_close(
    family: Family, dtype: torch.dtype, quantization: str | None
) -> None:
    """bfloat16 (the tower too) and int8 projections, chunked: each prompt's embedding within
    cosine 0.99 of transformers' float32 (tiny layers: run anyway, whatever their speed)."""
    loaded = load_model(
        str(family.directory),
        device=CPU,
        dtype=dtype,
        quantization=quantization,
        allow_slower_precision=True,
    )
    built = [family.prompt(parts, seed=i) for i, parts in enumerate(CONVERSATIONS)]
    outputs = _outputs(
        loaded,
        [ids for _, _, ids, _ in built],
        [media for *_, media in built],
        EMBED,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=5,
    )
    for (text, images, _, _), ours in zip(built, outputs, strict=True):
        want = family.reference.last_hidden(text, images).numpy()
        cosine = float(ours @ want / np.linalg.norm(ours) / np.linalg.norm(want))
        assert cosine >= 0.99


def test_image_runs_are_the_placeholder_runs(family: Family) -> None:
    _, _, ids, media = family.prompt(CONVERSATIONS[4], seed=2)
    assert media is not None
    inline = family.loaded.inline_images
    assert inline is not None
    runs = image_runs(RequestImages(media, ids, inline))
    assert len(runs) == len(media.grids) == 2
    for run, patches in zip(runs, media.patches, strict=True):
        assert (ids[run.start : run.end] == inline.image_token_id).all()
        assert ids[run.start - 1] == inline.vision_start_token_id
        assert ids[run.end] != inline.image_token_id
        assert run.num_patches == patches.shape[0]


@pytest.mark.parametrize("budget", [24, 200])
def test_a_steps_tower_work_stays_in_its_budget(
    family: Family, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step runs images of at most `budget` patches through the tower, or one image alone
    (one above the budget), and the outputs still equal transformers'."""
    steps: list[list[int]] = []
    run_tower = vision_rows._run_tower

    def record(tower: Any, pending: list[tuple[RequestImages, int]], device: Any) -> None:
        steps.append([images.media.patches[k].shape[0] for images, k in pending])
        run_tower(tower, pending, device)

    monkeypatch.setattr(vision_rows, "_run_tower", record)
    built = [family.prompt(parts, seed=i) for i, parts in enumerate(CONVERSATIONS)]
    outputs = _outputs(
        family.loaded,
        [ids for _, _, ids, _ in built],
        [media for *_, media in built],
        EMBED,
        max_num_batched_tokens=budget,
    )
    ran = [step for step in steps if step]
    assert sum(len(step) for step in ran) == 6  # every image once
    assert all(sum(step) <= budget or len(step) == 1 for step in ran), ran
    assert budget > 100 or any(len(step) == 1 and step[0] > budget for step in ran)
    for (text, images, _, _), ours in zip(built, outputs, strict=True):
        _assert_close(ours, family.reference.last_hidden(text, images))
