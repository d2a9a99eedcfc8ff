"""What a vision-language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, PaliGemma) needs of the images
inside its prompts: its processor's steps, the placeholder token an image's merged patches stand
on, and one prompt's images as they travel from a front end to the engine.

Read once by the engine from the checkpoint (`preprocessor_config.json`, the config's token
ids) and carried on the model card, so a front end turns each image into the vision tower's
patches exactly as transformers' Qwen2-VL image processor does (or, for a tower of fixed-size
images, SigLIP's: every image resized to one size, its patches one frame, none merged), without
torch. Torch-free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from poolserve.types.errors import ModelLoadError
from poolserve.types.images import RESAMPLING, ImageProcessing

# Qwen2VLImageProcessorPil's class defaults, where preprocessor_config.json is silent.
GRID_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,  # its size["shortest_edge"]
    "max_pixels": 28 * 28 * 1280,  # its size["longest_edge"]
    "resample": 3,  # bicubic
    "rescale_factor": 1 / 255,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),  # OPENAI_CLIP_MEAN
    "image_std": (0.26862954, 0.26130258, 0.27577711),  # OPENAI_CLIP_STD
}


@dataclass(frozen=True)
class GridProcessing:
    """Qwen2-VL's image processor (Qwen2VLImageProcessorPil): each image resized, aspect kept,
    to multiples of `patch_size * merge_size` with between `min_pixels` and `max_pixels` pixels,
    rescaled and normalized, then cut into patches flattened in the vision tower's order."""

    patch_size: int
    temporal_patch_size: int  # an image is its one frame repeated this many times
    merge_size: int  # merge_size x merge_size patches become one token of the decoder
    min_pixels: int
    max_pixels: int
    resample: int  # PILImageResampling number
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool
    channels: int = 3
    # every image resized to this (height, width), aspect not kept (SigLIP's processor, for
    # PaliGemma); None: smart_resize's size within the pixel bounds
    resize_to: tuple[int, int] | None = None

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of."""
        return self.patch_size * self.merge_size

    @property
    def patch_width(self) -> int:
        """Values in one patch: channels * temporal_patch_size * patch_size**2."""
        return self.channels * self.temporal_patch_size * self.patch_size**2


DIGEST_BYTES = 16
# The widest aspect ratio transformers' smart_resize takes (beyond it: an error, a 400 here).
MAX_ASPECT = 200
# An image's patch grid: (frames, rows, cols) in patches, as transformers' image_grid_thw.
Grid = tuple[int, int, int]
# What every Qwen-VL chat template writes for one image (vLLM's placeholder text for them).
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


@dataclass(frozen=True)
class RetrievalForms:
    """How a late-interaction retriever (ColQwen2, ColPali) writes its prompts, as its processor
    does: a text as `query_prefix + text + query_suffix` (ColPali's prefix opens with the BOS
    token, its tokenizer adding none); an image as `document`, whose one placeholder stands for
    the image's merged patches. A conversation's own text is no part of
    either: a document is an image alone."""

    query_prefix: str
    query_suffix: str  # the query augmentation tokens and the end ("<|endoftext|>" x 10 + "\n")
    document: str

    def query(self, text: str) -> str:
        """A text as the processor writes a query."""
        return f"{self.query_prefix}{text}{self.query_suffix}"


@dataclass(frozen=True)
class InlineImages:
    """How a vision-language model takes images inside a prompt: its processor, and the token
    its chat template writes for an image, repeated once per merged patch before it runs."""

    processing: GridProcessing
    image_token: str  # the placeholder's text, as the chat template writes it ("<|image_pad|>")
    image_token_id: int
    # the token before every image's placeholders; None: an image's placeholders open the
    # prompt (PaliGemma's processor writes the image first)
    vision_start_token_id: int | None
    # an image as text: the tokens of vision start, the placeholder and vision end, as vLLM
    # renders an image document in a score template (the checkpoint's tokens at load)
    placeholder: str = QWEN_PLACEHOLDER
    # M-RoPE positions for an image's tokens; False: every token at its index on all three
    # rows (ColQwen2, as transformers runs it)
    mrope: bool = True
    # a retriever's prompt forms (ColQwen2); None: prompts are rendered by the chat template
    retrieval: RetrievalForms | None = None

    def num_tokens(self, grid: Grid) -> int:
        """The decoder tokens an image of this patch grid becomes."""
        frames, rows, cols = grid
        return frames * rows * cols // self.processing.merge_size**2

    @property
    def most_pixels(self) -> int:
        """The most pixels a resized image can have: max_pixels, or, where an image as narrow
        as the processor allows (200:1) keeps its narrow side at one merge, that side times the
        long side's largest (smart_resize's floor at `factor` can pass max_pixels there)."""
        factor = self.processing.factor
        return max(self.processing.max_pixels, MAX_ASPECT * factor * factor)

    def check_grid(self, grid: Grid) -> None:
        """A grid the processor can make: one frame, whole merges, within the pixel bound."""
        frames, rows, cols = grid
        merge, patch = self.processing.merge_size, self.processing.patch_size
        pixels = rows * cols * patch * patch
        fixed = self.processing.resize_to
        if fixed is not None and (rows * patch, cols * patch) != fixed:
            raise ValueError(
                f"an image of {frames}x{rows}x{cols} patches; the model takes "
                f"{fixed[0] // patch}x{fixed[1] // patch}"
            )
        if (
            frames != 1
            or rows < merge
            or cols < merge
            or rows % merge
            or cols % merge
            or pixels > self.most_pixels
        ):
            raise ValueError(
                f"an image of {frames}x{rows}x{cols} patches; the model takes none such"
            )


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images, in the order of their placeholders in its token ids."""

    patches: tuple[np.ndarray, ...]  # each [frames * rows * cols, patch_width] float32
    grids: tuple[Grid, ...]
    # each image's image_digest, computed where its patches were cut (a front end's worker
    # thread), so the engine's one thread never hashes pixels; (): the engine computes them
    digests: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if len(self.patches) != len(self.grids) or not self.grids:
            raise ValueError("a prompt's images need one grid per patch array, and at least one")
        if self.digests and len(self.digests) != len(self.grids):
            raise ValueError("a prompt's images need one digest each, or none")

    @property
    def num_bytes(self) -> int:
        """The bytes its patches hold."""
        return sum(p.nbytes for p in self.patches)


def image_digest(patches: np.ndarray, grid: Grid) -> bytes:
    """A 16-byte hash of one image's grid and patches: equal images, equal digests (the prefix
    cache keys the blocks from a prompt's first image on by them)."""
    digest = hashlib.blake2b(np.asarray(grid, dtype=np.int64).tobytes(), digest_size=DIGEST_BYTES)
    digest.update(np.ascontiguousarray(patches).data)
    return digest.digest()


def read_grid_processing(config: Mapping[str, Any]) -> GridProcessing:
    """A preprocessor_config.json as Qwen2VLImageProcessorPil reads it (Qwen2-VL, Qwen2.5-VL
    and Qwen3-VL checkpoints alike): the pixel bounds as `min_pixels`/`max_pixels` or as `size`
    {shortest_edge, longest_edge} (the former win, as transformers' constructor has it), its
    class defaults where the file is silent. What the processor would run differently from
    `GridProcessing` (no resize, a bound missing or below one pixel, other than 3 channels'
    statistics) is refused here, at load, rather than served wrong."""
    if not _flag(config, "do_resize"):
        raise ModelLoadError(
            "preprocessor_config.json: do_resize false is not supported (each image is resized "
            "to whole merged patches)"
        )
    min_pixels, max_pixels = _pixel_bounds(config)
    normalize = _flag(config, "do_normalize")
    return GridProcessing(
        patch_size=_positive(config, "patch_size"),
        temporal_patch_size=_positive(config, "temporal_patch_size"),
        merge_size=_positive(config, "merge_size"),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        resample=_resample(config),
        rescale_factor=_number(config, "rescale_factor") if _flag(config, "do_rescale") else None,
        mean=_channels(config, "image_mean") if normalize else None,
        std=_channels(config, "image_std") if normalize else None,
        convert_rgb=_flag(config, "do_convert_rgb"),
    )


def fixed_processing(steps: ImageProcessing, patch_size: int) -> GridProcessing:
    """A fixed-size image processor (SigLIP's, read by types/images.py) as a tower's patches:
    every image resized to `steps.resize_to`, one frame, cut into `patch_size` patches that are
    each a token (none merged). Refused at load where the size is no whole number of patches,
    or the processor crops or keeps the aspect."""
    size = steps.resize_to
    if size is None or steps.crop_to is not None or steps.naflex is not None:
        raise ModelLoadError(
            "the image processor must resize every image to one size ({height, width}), "
            "without a crop"
        )
    if patch_size < 1 or size[0] % patch_size or size[1] % patch_size or min(size) < 1:
        raise ModelLoadError(
            f"the image processor's size {size[0]}x{size[1]} is no whole number of the "
            f"tower's {patch_size}-pixel patches"
        )
    return GridProcessing(
        patch_size=patch_size,
        temporal_patch_size=1,
        merge_size=1,
        min_pixels=size[0] * size[1],
        max_pixels=size[0] * size[1],
        resample=steps.resample,
        rescale_factor=steps.rescale_factor,
        mean=steps.mean,
        std=steps.std,
        convert_rgb=steps.convert_rgb,
        resize_to=size,
    )


def _pixel_bounds(config: Mapping[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels): `size`'s edges (the class's when there is no `size`), each
    replaced by a top-level min_pixels/max_pixels that is not null."""
    size = config.get("size")
    if size is None:
        bounds = {"shortest_edge": GRID_DEFAULTS["min_pixels"]}
        bounds["longest_edge"] = GRID_DEFAULTS["max_pixels"]
    elif isinstance(size, Mapping) and set(size) <= {"shortest_edge", "longest_edge"}:
        bounds = dict(size)
    else:
        raise ModelLoadError(
            f"preprocessor_config.json: size {size!r} is not supported (shortest_edge and "
            "longest_edge: the fewest and most pixels of a resized image)"
        )
    if config.get("min_pixels") is not None:
        bounds["shortest_edge"] = config["min_pixels"]
    if config.get("max_pixels") is not None:
        bounds["longest_edge"] = config["max_pixels"]
    low, high = bounds.get("shortest_edge"), bounds.get("longest_edge")
    if not (_is_int(low) and _is_int(high) and low >= 1 and high >= 1):
        raise ModelLoadError(
            f"preprocessor_config.json: the pixel bounds {low!r} and {high!r} must both be "
            "positive integers (min_pixels/max_pixels, or size's shortest_edge/longest_edge)"
        )
    return low, high


def _flag(config: Mapping[str, Any], name: str) -> bool:
    """A do_* switch: on unless the file turns it off (null is the class's default, on)."""
    value = config.get(name)
    return True if value is None else bool(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(config: Mapping[str, Any], name: str) -> int:
    """A size of the processor (patch, temporal patch, merge): a positive integer."""
    value = config.get(name)
    value = GRID_DEFAULTS[name] if value is None else value
    if not _is_int(value) or value < 1:
        raise ModelLoadError(
            f"preprocessor_config.json: {name} {value!r} is not a positive integer"
        )
    return int(value)


def _resample(config: Mapping[str, Any]) -> int:
    """The PIL resampling filter's number (bicubic unless the file names one)."""
    value = config.get("resample")
    value = GRID_DEFAULTS["resample"] if value is None else value
    if not _is_int(value) or value not in RESAMPLING:
        raise ModelLoadError(f"preprocessor_config.json: unknown resample {value!r}")
    return int(value)


def _number(config: Mapping[str, Any], name: str) -> float:
    value = config.get(name)
    value = GRID_DEFAULTS[name] if value is None else value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ModelLoadError(f"preprocessor_config.json: {name} {value!r} is not a number")
    return float(value)


def _channels(config: Mapping[str, Any], name: str) -> tuple[float, ...]:
    """A per-channel mean or std: three numbers, or one for every channel (as transformers'
    normalize repeats it)."""
    value = config.get(name)
    value = GRID_DEFAULTS[name] if value is None else value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    if (
        isinstance(value, list | tuple)
        and len(value) == 3
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    ):
        return tuple(float(v) for v in value)
    raise ModelLoadError(f"preprocessor_config.json: {name} {value!r} is not 3 channels' values")
