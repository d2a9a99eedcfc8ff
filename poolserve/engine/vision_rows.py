"""A vision-language request's images on the engine's side: where they sit in its prompt, its
positions (M-RoPE's, or sequential for ColQwen2), and the vision tower's rows, computed once
and kept for its later chunks.

The loop makes one `RequestImages` at admission. The worker thread runs the tower over every
image of a step whose first rows the step needs (batched in one call, whatever requests they
belong to), and cuts each chunk's rows out of its images' outputs: chunked prefill never runs
an image twice (vLLM's encoder cache), an image runs in the step that reaches it (so a long
prompt's images spread over its chunks), and its rows live as long as its request does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from poolserve.models.decoder import VisionRows
from poolserve.models.qwen_vision import VisionOutput
from poolserve.types.errors import InvalidRequestError
from poolserve.types.mrope import image_starts, prompt_positions
from poolserve.types.vision import InlineImages, PromptImages, image_digest


class ImageTower(Protocol):
    """A packed model whose image tokens come from a vision tower (models/vision_language.py)."""

    def embed_images(
        self, patches: torch.Tensor, grids: tuple[tuple[int, int, int], ...]
    ) -> VisionOutput:
        """Every image's merged tokens (and deepstack rows), images in order."""
        ...


class RequestImages:
    """One request's images; each image's `outputs` entry is written once, on the worker
    thread, in the step that first reaches its tokens."""

    def __init__(self, media: PromptImages, token_ids: np.ndarray, inline: InlineImages) -> None:
        try:
            starts = image_starts(token_ids, media.grids, inline)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "messages") from exc
        self.media = media
        self.positions = prompt_positions(
            len(token_ids), starts, media.grids, inline
        )  # [3, num_tokens]
        is_image = token_ids == inline.image_token_id  # [num_tokens]
        self.is_image = is_image
        # image tokens before each position: a chunk [a, b)'s rows are [before[a], before[b])
        self.before = np.concatenate([[0], np.cumsum(is_image)])  # [num_tokens + 1]
        # one past each image's last row among the prompt's image rows
        self.row_ends = np.cumsum([inline.num_tokens(grid) for grid in media.grids])
        self.first_image = starts[0]
        self.outputs: list[VisionOutput | None] = [None] * len(media.grids)  # per image
        self._digest: bytes | None = None

    def images_of(self, first_row: int, end_row: int) -> range:
        """The images whose rows [first_row, end_row) reach into."""
        first = int(np.searchsorted(self.row_ends, first_row, side="right"))
        last = int(np.searchsorted(self.row_ends, end_row, side="left"))
        return range(first, last + 1)

    def rows(self, first_row: int, end_row: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The tower's rows [first_row, end_row) of the prompt's image rows (their images run),
        and each deepstack layer's."""
        parts: list[VisionOutput] = []
        for image in self.images_of(first_row, end_row):
            out = self.outputs[image]
            assert out is not None, "an image runs through the tower before its rows are cut"
            start = int(self.row_ends[image]) - out.embeds.shape[0]
            lo, hi = max(first_row - start, 0), min(end_row - start, out.embeds.shape[0])
            parts.append(VisionOutput(out.embeds[lo:hi], tuple(d[lo:hi] for d in out.deepstack)))
        embeds = torch.cat([p.embeds for p in parts])
        layers = len(parts[0].deepstack)
        return embeds, tuple(torch.cat([p.deepstack[k] for p in parts]) for k in range(layers))

    @property
    def digest(self) -> bytes:
        """A hash of the images' grids and patches: cached blocks at and after the first image
        are found again only by a prompt with the same images (engine/sched/prefix_cache.py)."""
        if self._digest is None:
            media = self.media
            each = media.digests or tuple(
                image_digest(patches, grid)
                for patches, grid in zip(media.patches, media.grids, strict=True)
            )
            self._digest = b"".join(each)
        return self._digest


@dataclass(frozen=True)
class ChunkImages:
    """The image tokens of one chunk in a step: where they sit among the step's tokens, and
    which of its request's tower rows they take."""

    images: RequestImages
    offsets: np.ndarray  # [num_image_tokens] int64: places in the step's packed tokens
    first_row: int
    end_row: int


def chunk_images(
    images: RequestImages | None, start: int, num_tokens: int, offset: int
) -> ChunkImages | None:
    """The image tokens of a chunk [start, start + num_tokens) packed from `offset` on."""
    if images is None:
        return None
    first_row, end_row = int(images.before[start]), int(images.before[start + num_tokens])
    if first_row == end_row:
        return None
    places = np.flatnonzero(images.is_image[start : start + num_tokens]) + offset
    return ChunkImages(images, places.astype(np.int64), first_row, end_row)


def pending_patches(chunks: Sequence[ChunkImages]) -> int:
    """Patches of the images a step runs through the tower (none run yet): its tower's work."""
    pending = {
        (id(c.images), image): c.images.media.patches[image].shape[0]
        for c in chunks
        for image in c.images.images_of(c.first_row, c.end_row)
        if c.images.outputs[image] is None
    }
    return sum(pending.values())


def vision_rows(
    tower: ImageTower, chunks: Sequence[ChunkImages], device: torch.device
) -> VisionRows:
    """The step's image rows: the tower run once over every image the step reaches first,
    then each chunk's rows cut out in the step's order."""
    pending = {
        (id(c.images), image): (c.images, image)
        for c in chunks
        for image in c.images.images_of(c.first_row, c.end_row)
        if c.images.outputs[image] is None
    }
    _run_tower(tower, list(pending.values()), device)
    index = torch.from_numpy(np.concatenate([c.offsets for c in chunks])).to(device)
    cut = [c.images.rows(c.first_row, c.end_row) for c in chunks]
    embeds = torch.cat([rows for rows, _ in cut])
    layers = len(cut[0][1])
    deepstack = tuple(torch.cat([d[k] for _, d in cut]) for k in range(layers))
    return VisionRows(index, embeds, deepstack)


def _run_tower(
    tower: ImageTower, pending: list[tuple[RequestImages, int]], device: torch.device
) -> None:
    """The pending images through the tower in one call; each keeps its own rows."""
    if not pending:
        return
    patches = np.concatenate([images.media.patches[k] for images, k in pending])
    grids = tuple(images.media.grids[k] for images, k in pending)
    out = tower.embed_images(torch.from_numpy(patches).to(device), grids)
    end = 0
    for images, k in pending:
        start, end = end, end + int(images.row_ends[k]) - (int(images.row_ends[k - 1]) if k else 0)
        images.outputs[k] = VisionOutput(
            out.embeds[start:end], tuple(rows[start:end] for rows in out.deepstack)
        )
