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
# Siglip2ImageProcessor's patch_size and max_num_patches where the config is silent.
NAFLEX_DEFAULTS = (16, 256)


@dataclass(frozen=True)
class Naflex:
    """SigLIP 2's variable resolution (Siglip2ImageProcessor): each image resized, aspect kept,
    to a multiple of `patch_size` on both sides with at most `max_num_patches` patches."""

    patch_size: int
    max_num_patches: int


@dataclass(frozen=True)
class ImageProcessing:
    """One checkpoint's image processor (transformers' CLIP, SigLIP and SigLIP 2 processors)."""

    # resize: the shorter edge to this many pixels, aspect kept (CLIP), or to (height, width)
    shortest_edge: int | None
    resize_to: tuple[int, int] | None
    resample: int  # PILImageResampling number
    crop_to: tuple[int, int] | None  # center crop (height, width); None: no crop
    rescale_factor: float | None  # None: no rescale
    mean: tuple[float, ...] | None  # None: no normalization
    std: tuple[float, ...] | None
    convert_rgb: bool
    naflex: Naflex | None = None  # None: every image becomes the same size

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the pixel values every image becomes."""
        if self.naflex is not None:
            raise ModelLoadError("a naflex image processor has no fixed output size")
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
    def naflex(self) -> Naflex | None:
        """SigLIP 2's variable resolution; None: every image has `pixel_shape`."""
        return self.processing.naflex

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """[channels, height, width] of one image's pixel values (a fixed-size processor)."""
        return (self.channels, *self.processing.output_size)

    @property
    def patch_width(self) -> int:
        """Values in one naflex patch: patch_size * patch_size * channels."""
        naflex = self.naflex
        assert naflex is not None
        return naflex.patch_size**2 * self.channels

    def check_grid(self, rows: int, cols: int) -> None:
        """A naflex image's patch grid: at least one patch, at most max_num_patches."""
        naflex = self.naflex
        if naflex is None or rows < 1 or cols < 1 or rows * cols > naflex.max_num_patches:
            raise ValueError(f"an image of {rows}x{cols} patches; the model takes none such")

    def check_pixels(self, pixels: np.ndarray) -> None:
        """Pixel values as the model takes them: float32 [channels, height, width], or a
        naflex image's [rows, cols, patch_width] within max_num_patches."""
        if pixels.dtype != np.float32 or pixels.ndim != 3:
            raise ValueError(f"pixel values {pixels.shape} {pixels.dtype}; not float32 [3 dims]")
        if self.naflex is None:
            if pixels.shape != self.pixel_shape:
                raise ValueError(f"pixel values {pixels.shape}; the model takes {self.pixel_shape}")
            return
        rows, cols, width = pixels.shape
        if width != self.patch_width:
            raise ValueError(f"patches of {width} values; the model takes {self.patch_width}")
        self.check_grid(rows, cols)

    def prompt(self) -> np.ndarray:
        """What stands for an image among prompts: one placeholder id per tower token, so the
        step's token budget and admission count it as the tokens it costs (a naflex image: its
        tower's whole padded sequence, as transformers runs it)."""
        return np.zeros(self.num_tokens, dtype=np.int64)

    def batch(self, images: list[np.ndarray]) -> tuple[np.ndarray, tuple[tuple[int, int], ...]]:
        """A step's images as one array, and each naflex image's patch grid (none otherwise):
        [n, channels, height, width], or [n, most patches, patch_width] zero-padded."""
        if self.naflex is None:
            return np.stack(images), ()
        grids = tuple((int(p.shape[0]), int(p.shape[1])) for p in images)
        longest = max(rows * cols for rows, cols in grids)
        batched = np.zeros((len(images), longest, self.patch_width), dtype=np.float32)
        for row, (pixels, (rows, cols)) in enumerate(zip(images, grids, strict=True)):
            batched[row, : rows * cols] = pixels.reshape(rows * cols, -1)
        return batched, grids


def image_prompt(pixels: np.ndarray, inputs: ImageInputs | None) -> np.ndarray:
    """An image's placeholder prompt, once its pixel values are those the model takes."""
    if inputs is None:
        raise InvalidRequestError("this model takes no images: send text", "input")
    inputs.check_pixels(pixels)
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
    return ImageProcessing(shortest, resize_to, crop_to=crop, **_pixel_steps(config))


def _pixel_steps(config: Mapping[str, Any]) -> dict[str, Any]:
    """The steps every processor reads alike: resampling, rescale, normalization, RGB."""
    resample = int(config.get("resample", DEFAULT_RESAMPLE))
    if resample not in RESAMPLING:
        raise ModelLoadError(f"preprocessor_config.json: unknown resample {resample}")
    normalize = config.get("do_normalize", True)
    mean, std = config.get("image_mean"), config.get("image_std")
    if normalize and (mean is None or std is None):
        raise ModelLoadError("preprocessor_config.json: do_normalize without image_mean/std")
    return {
        "resample": resample,
        "rescale_factor": float(config.get("rescale_factor", DEFAULT_RESCALE))
        if config.get("do_rescale", True)
        else None,
        "mean": _triple(mean) if normalize else None,
        "std": _triple(std) if normalize else None,
        "convert_rgb": bool(config.get("do_convert_rgb", True)),
    }


def read_naflex(config: Mapping[str, Any]) -> ImageProcessing:
    """A Siglip2ImageProcessor's preprocessor_config.json (its resize is always on: a naflex
    image's sides must be whole patches)."""
    if not config.get("do_resize", True):
        raise ModelLoadError("preprocessor_config.json: a naflex processor with do_resize false")
    try:
        naflex = Naflex(
            int(config.get("patch_size", NAFLEX_DEFAULTS[0])),
            int(config.get("max_num_patches", NAFLEX_DEFAULTS[1])),
        )
    except (TypeError, ValueError) as exc:
        raise ModelLoadError("preprocessor_config.json: patch_size and max_num_patches") from exc
    if naflex.patch_size < 1 or naflex.max_num_patches < 1:
        raise ModelLoadError("preprocessor_config.json: patch_size and max_num_patches under 1")
    return ImageProcessing(None, None, crop_to=None, naflex=naflex, **_pixel_steps(config))


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
