"""Qwen-VL images as the vision tower's patches: `grid_patches` equals transformers'
`Qwen2VLImageProcessorPil` bit for bit (pixel_values and image_grid_thw) over sizes and aspects
(tiny, below min_pixels, above max_pixels, odd sides, 200:1), modes (RGB, RGBA, LA, L, 1, P with
and without transparency, CMYK, I;16) and the Qwen2-VL and Qwen3-VL configs (14-pixel patches
and CLIP's statistics; 16-pixel patches and 0.5), read by `read_grid_processing` in both of
transformers' spellings of the pixel bounds; a more lopsided image is a 400, not a 500.

transformers' default processor for these checkpoints (AutoImageProcessor) is the torchvision
one (`Qwen2VLImageProcessor`) where torchvision is installed, and this PIL one where it is not
(torchvision is not a dependency here). The torchvision processor resizes with torchvision's
antialiased bicubic rather than PIL's, so it is not bit-equal. Measured on
2026-12-03 (torchvision 0.28, transformers 5.24, this file's images in RGB, RGBA and L): the
same grids everywhere; pixel_values (after normalization) differ from the PIL processor's by at
most 0.030 (2 uint8 levels) for smooth images and for upscaling, and by up to 0.375 (25 uint8
levels, mean 0.0055) for random noise downscaled (Qwen2-VL's config at 640x480 and 1500x1100);
Qwen3-VL's config (0.5 statistics) at most 0.016 (torchvision is not a dependency: measured
once, not a test).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from poolserve.frontend.grid_images import grid_patches, image_grid
from poolserve.types.errors import InvalidImageError, ModelLoadError
from poolserve.types.vision import GridProcessing, read_grid_processing

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# The checkpoints' own files (Qwen/Qwen2-VL-2B-Instruct, Qwen/Qwen3-VL-2B-Instruct), and small
# bounds (tests/tiny_vl.py's) where an image above max_pixels costs little.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    },
    "qwen3_vl": {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "image_processor_type": "Qwen2VLImageProcessorFast",
    },
    "qwen2_vl_small": {"patch_size": 14, "min_pixels": 28 * 28, "max_pixels": 28 * 28 * 16},
    "qwen3_vl_small": {
        "patch_size": 16,
        "size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 16},
        "image_mean": 0.5,
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
    },
}
# (width, height): tiny, below and around min_pixels, odd sides, long and tall up to 200:1,
# a large photo (above every small config's max_pixels and Qwen2-VL's 1280 merged patches)
SIZES = [
    (1, 1),
    (3, 7),
    (27, 29),
    (56, 56),
    (57, 111),
    (97, 13),
    (200, 1),
    (3, 600),
    (255, 256),
    (640, 480),
    (333, 1001),
    (1500, 1100),
]
MODES = ["RGB", "RGBA", "LA", "L", "1", "P", "P_transparent", "CMYK", "I;16"]


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """A random image of the mode (edges and noise, so resampling filters differ)."""
    rng = np.random.default_rng(seed + width * 7919 + height)
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65535, (height, width), dtype=np.uint16))
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P_transparent":
        paletted = rgba.convert("RGB").convert("P")
        paletted.info["transparency"] = 3
        return paletted
    return rgba.convert(mode) if mode != "RGBA" else rgba


def reference(image: Image.Image, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' pixel_values and image_grid_thw of one image."""
    out = Qwen2VLImageProcessorPil(**config)(images=[image])
    return np.asarray(out["pixel_values"]), np.asarray(out["image_grid_thw"])


def assert_equal(image: Image.Image, config: dict[str, Any]) -> None:
    steps = read_grid_processing(config)
    got, grid = grid_patches(image, steps)
    want, want_grid = reference(image, config)
    assert got.dtype == want.dtype == np.float32
    assert got.shape == want.shape and got.flags.c_contiguous
    assert np.array_equal(got, want)
    assert list(grid) == want_grid.tolist()[0]
    assert image_grid(image.height, image.width, steps) == grid
    assert got.shape == (grid[0] * grid[1] * grid[2], steps.patch_width)


# every family at every size, but Qwen3-VL's real bounds above 300,000 pixels: the same path
# as qwen3_vl_small's there, at 60 MB of patches
SIZED = [
    (family, size)
    for family in CONFIGS
    for size in SIZES
    if not (family == "qwen3_vl" and size[0] * size[1] > 300_000)
]


@pytest.mark.parametrize(
    ("family", "size"), SIZED, ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v))
)
def test_sizes_equal_transformers(family: str, size: tuple[int, int]) -> None:
    assert_equal(picture(*size), CONFIGS[family])


@pytest.mark.parametrize("family", CONFIGS)
@pytest.mark.parametrize("mode", MODES)
def test_modes_equal_transformers(family: str, mode: str) -> None:
    assert_equal(picture(45, 31, mode, seed=1), CONFIGS[family])


def test_every_resample_and_no_rescale_or_normalization() -> None:
    image = picture(131, 77, "RGBA", seed=2)
    for resample in range(6):
        assert_equal(image, {**CONFIGS["qwen2_vl_small"], "resample": resample})
    assert_equal(image, {**CONFIGS["qwen2_vl_small"], "do_rescale": False})
    assert_equal(image, {**CONFIGS["qwen2_vl_small"], "do_normalize": False})
    assert_equal(image, {**CONFIGS["qwen3_vl_small"], "do_rescale": False, "do_normalize": False})
    assert_equal(image, {**CONFIGS["qwen2_vl_small"], "rescale_factor": 1 / 127.5})
    assert_equal(image, {**CONFIGS["qwen2_vl_small"], "temporal_patch_size": 1, "merge_size": 1})
    assert_equal(image, {**CONFIGS["qwen2_vl_small"], "temporal_patch_size": 3, "merge_size": 3})
    assert_equal(image.convert("RGB"), {**CONFIGS["qwen2_vl_small"], "do_convert_rgb": False})


def test_read_from_a_saved_checkpoint_as_transformers_loads_it(tmp_path: Path) -> None:
    """from_pretrained of the file, not only the constructor: the same steps."""
    for family in ("qwen2_vl", "qwen3_vl"):
        folder = tmp_path / family
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text(json.dumps(CONFIGS[family]))
        loaded = Qwen2VLImageProcessorPil.from_pretrained(folder)
        steps = read_grid_processing(json.loads((folder / "preprocessor_config.json").read_text()))
        assert (steps.min_pixels, steps.max_pixels) == (
            loaded.size["shortest_edge"],
            loaded.size["longest_edge"],
        )
        image = picture(300, 170, seed=3)
        want = np.asarray(loaded(images=[image])["pixel_values"])
        assert np.array_equal(grid_patches(image, steps)[0], want)


def test_both_spellings_and_the_defaults() -> None:
    defaults = read_grid_processing({})
    processor = Qwen2VLImageProcessorPil()
    assert defaults == GridProcessing(
        patch_size=processor.patch_size,
        temporal_patch_size=processor.temporal_patch_size,
        merge_size=processor.merge_size,
        min_pixels=processor.size["shortest_edge"],
        max_pixels=processor.size["longest_edge"],
        resample=int(processor.resample),
        rescale_factor=processor.rescale_factor,
        mean=tuple(processor.image_mean),
        std=tuple(processor.image_std),
        convert_rgb=True,
    )
    bounds = {"min_pixels": 1000, "max_pixels": 9000}
    size = {"size": {"shortest_edge": 1000, "longest_edge": 9000}}
    assert read_grid_processing(bounds) == read_grid_processing(size)
    # the top-level bounds win over size's, one at a time; null is the default
    both = read_grid_processing({**size, "min_pixels": 500, "max_pixels": None})
    assert (both.min_pixels, both.max_pixels) == (500, 9000)
    half = read_grid_processing({"max_pixels": 4096})
    assert (half.min_pixels, half.max_pixels) == (56 * 56, 4096)
    for config in ({**size, "min_pixels": 500}, {"max_pixels": 4096}, {"do_resize": None}):
        processor = Qwen2VLImageProcessorPil(**config)
        steps = read_grid_processing(config)
        assert (steps.min_pixels, steps.max_pixels) == (
            processor.size["shortest_edge"],
            processor.size["longest_edge"],
        )
    assert read_grid_processing({"do_normalize": False}).mean is None
    assert read_grid_processing({"do_rescale": False}).rescale_factor is None


@pytest.mark.parametrize(
    "config",
    [
        {"do_resize": False},
        {"size": {"height": 224, "width": 224}},
        {"size": 224},
        {"size": {"shortest_edge": 3136}},
        {"min_pixels": 0},
        {"max_pixels": 12.5},
        {"patch_size": 0},
        {"merge_size": "2"},
        {"resample": 9},
        {"image_mean": [0.5, 0.5]},
        {"image_std": "0.5"},
        {"rescale_factor": "1/255"},
    ],
)
def test_what_cannot_be_honoured_is_refused_at_load(config: dict[str, Any]) -> None:
    with pytest.raises(ModelLoadError, match=r"preprocessor_config\.json"):
        read_grid_processing(config)


@pytest.mark.parametrize("size", [(201, 1), (1, 402), (1000, 4)])
def test_a_lopsided_image_is_a_400(size: tuple[int, int]) -> None:
    steps = read_grid_processing(CONFIGS["qwen2_vl"])
    with pytest.raises(ValueError, match="aspect ratio"):
        reference(picture(*size), CONFIGS["qwen2_vl"])  # transformers refuses it too
    with pytest.raises(InvalidImageError) as info:
        grid_patches(picture(*size), steps, "messages[0].content[1]")
    assert info.value.status == 400 and info.value.param == "messages[0].content[1]"
    assert "200" in info.value.message
    with pytest.raises(InvalidImageError):
        image_grid(size[1], size[0], steps)


def test_an_image_not_rgb_without_conversion_is_a_400() -> None:
    steps = read_grid_processing({"do_convert_rgb": False})
    with pytest.raises(InvalidImageError, match="RGBA"):
        grid_patches(picture(40, 40, "RGBA"), steps)
