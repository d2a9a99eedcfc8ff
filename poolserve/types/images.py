"""What a model that takes images needs of them: its processor's steps and an image's cost.

Read once by the engine from the checkpoint's `preprocessor_config.json` and carried on the
model card, so a front end turns a decoded image into the model's pixel values (frontend/
images.py) exactly as the checkpoint's transformers image processor does, without torch.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from poolserve.types.errors import InvalidRequestError, ModelLoadError

# PIL's resampling filters by the numbers transformers' processors save (PILImageResampling).
RESAMPLING = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
# What transformers' image processors default to where preprocessor_config.json is silent.
DEFAULT_RESAMPLE = 2
DEFAULT_RESCALE = 1 / 255


@dataclass(frozen=True)
class ImageProcessing:
    """One checkpoint's image processor (transformers' CLIP and SigLIP processors' steps)."""

    # resize: the shorter edge to this many pixels, aspect kept (CLIP), or to (height, width)
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    resample: int  # PILImageResampling number
    crop_to: tuple[int, int] | None  # center crop (height, width); None: no crop
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the pixel values every image becomes."""
        if self.crop_to is not None:
            return self.crop_to
        if self.resize_to is not None:
            return self.resize_to
        raise ModelLoadError("an image processor without a fixed output size is not supported")


@dataclass(frozen=True)
class ImageInputs:
    """How a model takes images: its processor, the tokens one image costs, its tower's size."""

    processing: ImageProcessing
    num_tokens: int  # the vision tower's sequence length: what an image counts in a step
    embedding_size: int  # width of an image's embedding (the shared space of both towers)
    channels: int = 3

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """[channels, height, width] of one image's pixel values."""
        return (self.channels, *self.processing.output_size)

    def prompt(self) -> np.ndarray:
        """What stands for an image among prompts: one placeholder id per tower token, so the
        step's token budget and admission count it as the tokens it costs."""
        return np.zeros(self.num_tokens, dtype=np.int64)


def image_prompt(pixels: np.ndarray, inputs: ImageInputs | None) -> np.ndarray:
    """An image's placeholder prompt, once its pixel values are those the model takes."""
    if inputs is None:
        raise InvalidRequestError("this model takes no images: send text", "input")
    if pixels.shape != inputs.pixel_shape or pixels.dtype != np.float32:
        raise ValueError(
            f"pixel values {pixels.shape} {pixels.dtype}; the model takes "
            f"{inputs.pixel_shape} float32"
        )
    return inputs.prompt()


def read_processing(config: Mapping[str, Any], *, square: bool) -> ImageProcessing:
    """A preprocessor_config.json as transformers' CLIP and SigLIP image processors read it;
    `square`: a bare number as `size` means (n, n) (SigLIP), else the shorter edge (CLIP)."""
    size = config.get("size")
    shortest = resize_to = None
    if config.get("do_resize", True):
        shortest, resize_to = _size(size, "size")
        if square and shortest is not None and isinstance(size, int):
            shortest, resize_to = None, (size, size)
    crop = None
    if config.get("do_center_crop", False):
        crop_shortest, crop = _size(config.get("crop_size", size), "crop_size")
        if crop is None:  # an int crop size is a square
            crop = (crop_shortest or 0, crop_shortest or 0)
    resample = int(config.get("resample", DEFAULT_RESAMPLE))
    if resample not in RESAMPLING:
        raise ModelLoadError(f"preprocessor_config.json: unknown resample {resample}")
    normalize = config.get("do_normalize", True)
    mean, std = config.get("image_mean"), config.get("image_std")
    if normalize and (mean is None or std is None):
        raise ModelLoadError("preprocessor_config.json: do_normalize without image_mean/std")
    return ImageProcessing(
        shortest_edge=shortest,
        resize_to=resize_to,
        resample=resample,
        crop_to=crop,
        rescale_factor=float(config.get("rescale_factor", DEFAULT_RESCALE))
        if config.get("do_rescale", True)
        else None,
        mean=_triple(mean) if normalize else None,
        std=_triple(std) if normalize else None,
        convert_rgb=bool(config.get("do_convert_rgb", True)),
    )


def _size(size: object, name: str) -> tuple[int | None, tuple[int, int] | None]:
    """(shortest edge, None) or (None, (height, width)) of a processor's size field."""
    if isinstance(size, int):
        return size, None
    if isinstance(size, Mapping):
        if "height" in size and "width" in size:
            return None, (int(size["height"]), int(size["width"]))
        if "shortest_edge" in size and "longest_edge" not in size:
            return int(size["shortest_edge"]), None
    raise ModelLoadError(f"preprocessor_config.json: {name} {size!r} is not supported")


def _triple(values: object) -> tuple[float, ...]:
    """A per-channel mean or std (a single number stands for every channel)."""
    if isinstance(values, int | float):
        return (float(values),) * 3
    if isinstance(values, list | tuple) and len(values) == 3:
        return tuple(float(v) for v in values)
    raise ModelLoadError(f"preprocessor_config.json: per-channel values {values!r}")
