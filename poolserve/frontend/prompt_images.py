"""A vision-language model's prompts with their images (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), once a
template has written them: the checks, the images loaded and cut into patches, and each
placeholder repeated once per merged patch of its image.

Whatever wrote the prompt (a chat template around a conversation, inline_images.py; a score
template around a query and an image document, score_images.py), the rest is the same and in
this order, the cheap checks first: one placeholder per image, each opened as an image; the
images decoded (media.py: its limits, budgets and threads); their grids from their sizes
alone, so a prompt too long is refused before any patch is cut; then the patches and their
digests cut in worker threads under the process's patch budget, given back once sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
from PIL import Image

from poolserve.frontend.grid_images import grid_patches, image_grid
from poolserve.frontend.media import Budgets, MediaLimits, load_image
from poolserve.frontend.texts import InputTooLongError
from poolserve.types.errors import InvalidRequestError
from poolserve.types.vision import Grid, GridProcessing, InlineImages, PromptImages, image_digest


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: its reference (data URL, base64, URL) and where the body holds it."""

    ref: str
    where: str


class HoldsImages(Protocol):
    """A prompt's images in the order of its placeholders, and where the body holds it."""

    @property
    def images(self) -> tuple[ImageRef, ...]: ...

    @property
    def where(self) -> str: ...


@dataclass(frozen=True)
class LengthBound:
    """How long a prompt with images may be: it is never cut (its placeholders must match its
    images), so a cut the request asks is the most tokens it may have."""

    keep: int  # the most tokens: the limit, or a cut the request asked
    limit: int  # the model's own (max_model_len)
    limit_name: str = "max_model_len"
    template: str = "chat template"  # what wrote the placeholders, as errors name it


@dataclass(frozen=True)
class InlinePrompts:
    """A request's prompts with their images, and how to give back the patches' memory."""

    token_ids: list[list[int]]
    media: list[PromptImages | None]
    release: Callable[[], None]  # once the patches are sent (their budget's bytes given back)


def check_image_count(refs: Sequence[ImageRef], limit: int) -> None:
    """400 before any image is loaded when a request holds more than `limit` images."""
    if len(refs) > limit:
        raise InvalidRequestError(
            f"{len(refs)} images in one request, more than the limit of {limit} "
            "(--max-images-per-request)",
            refs[0].where.split("[")[0],
        )


async def place_images(
    prompts: Sequence[HoldsImages],
    rendered: Sequence[Sequence[int]],
    inline: InlineImages,
    bound: LengthBound,
    limits: MediaLimits,
    budgets: Budgets,
) -> InlinePrompts:
    """Each rendered prompt's token ids with its placeholders expanded, and its images as
    patches (None: a prompt of text alone): the cheap checks (placeholders, then lengths from
    the images' sizes) before the patches are cut, under the process's patch budget."""
    for prompt, ids in zip(prompts, rendered, strict=True):
        check_placeholders(prompt, ids, inline, bound.template)
    loaded = await _load(prompts, limits, budgets)
    grids = [
        tuple(_grid(image, ref, inline) for image, ref in zip(images, p.images, strict=True))
        for p, images in zip(prompts, loaded, strict=True)
    ]
    for prompt, ids, grid in zip(prompts, rendered, grids, strict=True):
        _check_length(prompt, _expanded_length(ids, grid, inline), bound)
    held = sum(_patch_bytes(grid, inline) for grid in grids)
    await budgets.patches.take(held)  # given back once sent (the Batch's release)
    try:
        media = await _patched(prompts, loaded, grids, inline)
    except BaseException:
        budgets.patches.give(held)
        raise
    expanded = [expand(ids, grid, inline) for ids, grid in zip(rendered, grids, strict=True)]
    return InlinePrompts(expanded, media, partial(budgets.patches.give, held))


def _patch_bytes(grids: Sequence[Grid], inline: InlineImages) -> int:
    """Bytes the images of these grids are as patches (float32)."""
    width = inline.processing.patch_width
    return sum(frames * rows * cols * width * 4 for frames, rows, cols in grids)


async def _load(
    prompts: Sequence[HoldsImages], limits: MediaLimits, budgets: Budgets
) -> list[list[Image.Image]]:
    """Every prompt's images, decoded (media.py: its limits, budgets and threads)."""
    refs = [ref for p in prompts for ref in p.images]
    images = iter(
        await asyncio.gather(*(load_image(r.ref, limits, budgets, what=r.where) for r in refs))
    )
    return [[next(images) for _ in p.images] for p in prompts]


async def _patched(
    prompts: Sequence[HoldsImages],
    loaded: Sequence[Sequence[Image.Image]],
    grids: Sequence[tuple[Grid, ...]],
    inline: InlineImages,
) -> list[PromptImages | None]:
    """Each prompt's images as patches, each image in a worker thread (None: a prompt of text
    alone)."""
    steps = inline.processing
    work = [
        asyncio.to_thread(_cut, image, steps, ref.where)
        for p, images in zip(prompts, loaded, strict=True)
        for image, ref in zip(images, p.images, strict=True)
    ]
    cut = iter(await asyncio.gather(*work))
    media: list[PromptImages | None] = []
    for grid in grids:
        pieces = [next(cut) for _ in grid]
        arrays, digests = tuple(p for p, _ in pieces), tuple(d for _, d in pieces)
        media.append(PromptImages(arrays, grid, digests) if grid else None)
    return media


def _cut(image: Image.Image, steps: GridProcessing, where: str) -> tuple[np.ndarray, bytes]:
    """One image's patches and their digest, both in the worker thread (hashing an image's
    megabytes never runs on an event loop, the engine's included)."""
    patches, grid = grid_patches(image, steps, where)
    return patches, image_digest(patches, grid)


def check_placeholders(
    prompt: HoldsImages, ids: Sequence[int], inline: InlineImages, template: str
) -> None:
    """One placeholder per image, each right after the token that opens an image (which the
    model's positions count images by), or, for a model with none (PaliGemma), opening the
    prompt: else 400, before any image is loaded."""
    token = inline.image_token_id
    found = [i for i, token_id in enumerate(ids) if token_id == token]
    count = len(prompt.images)
    if len(found) != count:
        raise InvalidRequestError(
            f"{prompt.where}: the {template} wrote {len(found)} image placeholders "
            f"({inline.image_token}) for {count} image{'s' if count != 1 else ''}; every image "
            "needs its one placeholder, and a text may not write one",
            prompt.where,
        )
    start = inline.vision_start_token_id
    if any(i != 0 if start is None else i == 0 or ids[i - 1] != start for i in found):
        raise InvalidRequestError(
            f"{prompt.where}: an image placeholder ({inline.image_token}) the {template} "
            "did not open as an image; a text may not write one",
            prompt.where,
        )


def _grid(image: Image.Image, ref: ImageRef, inline: InlineImages) -> Grid:
    """The image's patch grid, from its size alone; 400 for one the processor refuses."""
    grid = image_grid(image.height, image.width, inline.processing, ref.where)
    try:
        inline.check_grid(grid)
    except ValueError as exc:
        raise InvalidRequestError(f"{ref.where}: {exc}", ref.where, "invalid_image") from None
    return grid


def _expanded_length(ids: Sequence[int], grids: Sequence[Grid], inline: InlineImages) -> int:
    """The prompt's length once each placeholder stands for its image's merged patches."""
    return len(ids) + sum(inline.num_tokens(grid) - 1 for grid in grids)


def _check_length(prompt: HoldsImages, length: int, bound: LengthBound) -> None:
    """400 for a prompt with images above the model's limit, or above a truncation the
    request asked: a prompt with images is never cut (its placeholders must match its
    images)."""
    if length <= bound.keep:
        return
    asked = bound.keep != bound.limit
    said = "the truncation asked (it never cuts images)" if asked else bound.limit_name
    raise InputTooLongError(
        f"{prompt.where} has {length} tokens with its images, more than {bound.keep} "
        f"({said}); send fewer or smaller images, or less text",
        prompt.where,
    )


def expand(ids: Sequence[int], grids: Sequence[Grid], inline: InlineImages) -> list[int]:
    """The token ids with the i-th image placeholder repeated once per merged patch of the
    i-th grid (Qwen2VLProcessor's expansion of `<|image_pad|>`)."""
    token = inline.image_token_id
    counts = iter(inline.num_tokens(grid) for grid in grids)
    expanded: list[int] = []
    for token_id in ids:
        if token_id == token:
            expanded.extend([token] * next(counts))
        else:
            expanded.append(token_id)
    return expanded
