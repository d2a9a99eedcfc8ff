"""The front end's pixel values (poolserve/frontend/images.py, numpy and Pillow only) equal
transformers' PIL image processors' byte for byte: CLIP's and SigLIP's [3, H, W], and SigLIP 2's
naflex patches, grid (spatial_shapes) and patch count (pixel_attention_mask) for images of every
aspect, from one pixel to a thousand-to-three strip."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb
from transformers.models.siglip2.image_processing_pil_siglip2 import (
    get_image_size_for_max_num_patches,
)

from poolserve.frontend.images import naflex_size, pixel_values
from poolserve.models.dual_encoder import FAMILIES as DUAL_FAMILIES
from poolserve.types.errors import ModelLoadError
from poolserve.types.images import Naflex, read_naflex, read_processing
from tests.tiny_images import FAMILIES, Reference, images, save_dual_encoder

SIZES = [(5, 300), (300, 7), (1, 1), (64, 64), (17, 200), (1000, 3), (33, 31), (2, 9)]


def _pictures() -> list[Image.Image]:
    rng = np.random.default_rng(3)
    extra = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return images(6) + extra


def _rgb(picture: Image.Image) -> Image.Image:
    """The picture as the server loads it (media.load_image)."""
    return Image.fromarray(convert_to_rgb(picture, return_numpy=True))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    family = request.param
    yield family, save_dual_encoder(family, tmp_path_factory.mktemp(family))


def test_pixel_values_equal_the_processors(checkpoint: tuple[str, Path]) -> None:
    family, directory = checkpoint
    config = json.loads((directory / "preprocessor_config.json").read_text())
    row = DUAL_FAMILIES[family]
    steps = read_naflex(config) if row.naflex else read_processing(config, square=row.square_sizes)
    pictures = _pictures()
    want = Reference(directory, family).pixels(pictures)
    for index, picture in enumerate(pictures):
        got = pixel_values(_rgb(picture), steps)
        assert got.dtype == np.float32
        if not row.naflex:
            assert np.array_equal(got, want["pixel_values"][index].numpy())
            continue
        rows, cols, width = got.shape
        assert [rows, cols] == want["spatial_shapes"][index].tolist()
        count = int(want["pixel_attention_mask"][index].sum())
        assert count == rows * cols
        assert want["pixel_attention_mask"][index, :count].all()
        expected = want["pixel_values"][index].numpy()
        assert np.array_equal(got.reshape(count, width), expected[:count])


@pytest.mark.parametrize(("patch", "budget"), [(16, 256), (16, 1024), (14, 729), (4, 24)])
def test_the_naflex_size_search_is_transformers(patch: int, budget: int) -> None:
    rng = np.random.default_rng(patch + budget)
    sizes = [*SIZES, *(tuple(int(v) for v in rng.integers(1, 4000, 2)) for _ in range(40))]
    for height, width in sizes:
        got = naflex_size(height, width, Naflex(patch, budget))
        assert got == get_image_size_for_max_num_patches(height, width, patch, budget)
        assert got[0] % patch == 0 and got[1] % patch == 0
        assert (got[0] // patch) * (got[1] // patch) <= budget


def test_a_naflex_config_is_read_with_transformers_defaults() -> None:
    steps = read_naflex({"image_mean": [0.5] * 3, "image_std": [0.5] * 3})
    assert steps.naflex == Naflex(16, 256)  # Siglip2ImageProcessor's class defaults
    assert steps.resample == 2 and steps.rescale_factor == pytest.approx(1 / 255)
    with pytest.raises(ModelLoadError, match="no fixed output size"):
        _ = steps.output_size


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"do_resize": False}, "do_resize false"),
        ({"patch_size": 0}, "under 1"),
        ({"max_num_patches": "many"}, "max_num_patches"),
        ({"resample": 9}, "unknown resample"),
    ],
)
def test_what_a_naflex_config_cannot_be_is_refused(config: dict[str, object], said: str) -> None:
    base = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    with pytest.raises(ModelLoadError, match=said):
        read_naflex({**base, **config})
