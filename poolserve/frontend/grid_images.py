"""A decoded image as a Qwen-VL vision tower's patches, equal to transformers' processor's (or a
fixed-size tower's: SigLIP's processor for PaliGemma, every image resized to one size).

The steps and their number types are those of `Qwen2VLImageProcessorPil` (transformers 5.x,
Qwen2-VL, Qwen2.5-VL and Qwen3-VL checkpoints alike): RGB with transparency composited onto
white, `smart_resize` of the size (whole merged patches, the pixel count within bounds, the
aspect kept), PIL's resize of the uint8 image with the processor's filter, the rescale computed
in float64 then stored as float32, the normalization in float32, and the patches flattened in
the tower's order, the one frame repeated `temporal_patch_size` times. A fixed-size processor
(`resize_to`: `SiglipImageProcessorPil`'s steps, which are the same but for the size) takes any
aspect; its patches, one frame and none merged, are the tower's patch embedding's input in
order. Numpy and Pillow only: a front end never loads torch. Runs in a worker thread.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from poolserve.frontend.images import _rgb, rescaled
from poolserve.types.errors import InvalidImageError
from poolserve.types.vision import MAX_ASPECT, Grid, GridProcessing


def grid_patches(
    image: Image.Image, steps: GridProcessing, what: str = "image"
) -> tuple[np.ndarray, Grid]:
    """[t * h * w, channels * temporal * patch**2] float32 patches of one decoded image and its
    (t, h, w) grid in patches: the processor's `pixel_values` and `image_grid_thw` row.

    Raises InvalidImageError (400, naming `what`) for an image the processor refuses: more than
    200 times longer than wide or the other way round, or not RGB when the checkpoint asks no
    conversion to RGB (its tower takes three channels).
    """
    if steps.convert_rgb:
        image = _rgb(image)
    elif image.mode != "RGB":
        raise InvalidImageError(f"{what}: a {image.mode} image; this model takes RGB images", what)
    height, width = grid_size(image.height, image.width, steps, what)
    image = image.resize((width, height), resample=Image.Resampling(steps.resample))
    pixels = np.moveaxis(np.asarray(image), -1, 0)  # [3, height, width] uint8
    pixels = rescaled(pixels, steps.rescale_factor, steps.mean, steps.std)
    patch = steps.patch_size
    grid = (1, height // patch, width // patch)
    return _patches(pixels.astype(np.float32, copy=False), steps), grid


def grid_size(
    height: int, width: int, steps: GridProcessing, what: str = "image"
) -> tuple[int, int]:
    """(height, width) the image is resized to: transformers' `smart_resize`, step for step (its
    Python floats and rounding), its aspect-ratio refusal a 400 naming `what`; a fixed-size
    processor's one size."""
    factor = steps.factor
    if min(height, width) < 1:
        raise InvalidImageError(f"{what}: an image of {width}x{height} pixels holds none", what)
    if steps.resize_to is not None:
        return steps.resize_to
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise InvalidImageError(
            f"{what}: an image of {width}x{height} pixels; this model takes images at most "
            f"{MAX_ASPECT} times longer than wide (or wider than long)",
            what,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > steps.max_pixels:
        beta = math.sqrt((height * width) / steps.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < steps.min_pixels:
        beta = math.sqrt(steps.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, steps: GridProcessing, what: str = "image") -> Grid:
    """The (t, h, w) patch grid an image of this size becomes, known from its header alone."""
    resized_height, resized_width = grid_size(height, width, steps, what)
    return 1, resized_height // steps.patch_size, resized_width // steps.patch_size


def _patches(pixels: np.ndarray, steps: GridProcessing) -> np.ndarray:
    """[C, H, W] as [rows * cols, C * temporal * patch * patch]: merge blocks row by row, the
    patches of a block row by row, each patch's values by channel, then frame, then pixel
    (Qwen2VLImageProcessorPil.patchify's transpose; the frame repeated, not stored twice)."""
    channels, height, width = pixels.shape
    patch, merge, temporal = steps.patch_size, steps.merge_size, steps.temporal_patch_size
    rows, cols = height // patch, width // patch
    blocks = pixels.reshape(channels, rows // merge, merge, patch, cols // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [rows/m, cols/m, m, m, C, patch, patch]
    frames = np.broadcast_to(
        blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal, patch, patch)
    )
    return np.ascontiguousarray(frames.reshape(rows * cols, channels * temporal * patch * patch))
