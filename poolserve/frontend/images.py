"""A decoded image as the model's pixel values, equal to its transformers image processor's.

The steps and their number types are those of transformers' PIL image processors (CLIP's,
SigLIP's and SigLIP 2's): RGB with transparency composited onto white, PIL's resize of the uint8
image, a center crop, the rescale computed in float64 then stored as float32, and the
normalization in float32; SigLIP 2's naflex size search and patches as Siglip2ImageProcessorPil
makes them. Numpy and Pillow only: a front end never loads torch. Runs in a worker thread.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from poolserve.types.images import ImageProcessing, Naflex

# Siglip2ImageProcessor's binary search for the largest scale that fits max_num_patches.
NAFLEX_EPS = 1e-5
NAFLEX_SCALE_MAX = 100.0


def pixel_values(image: Image.Image, steps: ImageProcessing) -> np.ndarray:
    """[3, height, width] float32 pixel values of one decoded image; a naflex processor's:
    [rows, cols, patch_size * patch_size * 3], its patches in transformers' order."""
    if steps.convert_rgb:
        image = _rgb(image)
    if steps.naflex is not None:
        height, width = naflex_size(image.height, image.width, steps.naflex)
        image = image.resize((width, height), resample=Image.Resampling(steps.resample))
    elif steps.resize_to is not None or steps.shortest_edge is not None:
        height, width = _resized(image.height, image.width, steps)
        image = image.resize((width, height), resample=Image.Resampling(steps.resample))
    array = np.asarray(image)  # [height, width, 3] uint8
    if array.ndim == 2:
        array = array[:, :, None]
    pixels = np.moveaxis(array, -1, 0)  # [3, height, width]
    if steps.crop_to is not None:
        pixels = _center_crop(pixels, steps.crop_to)
    pixels = rescaled(pixels, steps.rescale_factor, steps.mean, steps.std)
    if steps.naflex is not None:
        pixels = _patches(pixels.astype(np.float32, copy=False), steps.naflex.patch_size)
    return np.ascontiguousarray(pixels, dtype=np.float32)


def rescaled(
    pixels: np.ndarray,  # [channels, height, width] uint8
    factor: float | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
) -> np.ndarray:  # [channels, height, width]
    """transformers' rescale (in float64, stored as float32) then normalization (in float32),
    each where the processor does it."""
    if factor is not None:
        pixels = (pixels.astype(np.float64) * factor).astype(np.float32)
    if mean is not None and std is not None:
        pixels = pixels.astype(np.float32, copy=False)
        shift = np.asarray(mean, dtype=np.float32)[:, None, None]
        scale = np.asarray(std, dtype=np.float32)[:, None, None]
        pixels = (pixels - shift) / scale
    return pixels


def naflex_size(height: int, width: int, naflex: Naflex) -> tuple[int, int]:
    """(height, width) of an image resized for SigLIP 2: whole patches on both sides, the
    aspect kept, at most max_num_patches (get_image_size_for_max_num_patches, step for step)."""
    patch = naflex.patch_size

    def scaled(scale: float, size: int) -> int:
        return int(max(patch, math.ceil(size * scale / patch) * patch))

    low, high = NAFLEX_EPS / 10, NAFLEX_SCALE_MAX
    while high - low >= NAFLEX_EPS:
        scale = (low + high) / 2
        patches = (scaled(scale, height) / patch) * (scaled(scale, width) / patch)
        if patches <= naflex.max_num_patches:
            low = scale
        else:
            high = scale
    return scaled(low, height), scaled(low, width)


def _patches(pixels: np.ndarray, patch: int) -> np.ndarray:
    """[C, H, W] as [rows, cols, patch * patch * C], each patch's values row by row, channels
    last (Siglip2's convert_image_to_patches, its rows and columns kept apart)."""
    channels, height, width = pixels.shape
    rows, cols = height // patch, width // patch
    grid = pixels.reshape(channels, rows, patch, cols, patch).transpose(1, 3, 2, 4, 0)
    return grid.reshape(rows, cols, patch * patch * channels)


def _rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with transparency composited onto white first (transformers' rule)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _resized(height: int, width: int, steps: ImageProcessing) -> tuple[int, int]:
    """(height, width) after the resize: a fixed size, or the shorter edge with aspect kept."""
    if steps.resize_to is not None:
        return steps.resize_to
    size = steps.shortest_edge
    assert size is not None
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (new_long, size) if width <= height else (size, new_long)


def _center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The centre `size` of [C, H, W]; an image smaller than it is padded with zeros first."""
    height, width = pixels.shape[-2:]
    crop_h, crop_w = size
    top, left = (height - crop_h) // 2, (width - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + crop_h, left : left + crop_w]
    new_h, new_w = max(crop_h, height), max(crop_w, width)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    pad_top, pad_left = -(-(new_h - height) // 2), -(-(new_w - width) // 2)
    padded[:, pad_top : pad_top + height, pad_left : pad_left + width] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top) : top + crop_h, max(0, left) : left + crop_w]
