"""SigLIP 2 (naflex) against transformers on a tiny random Siglip2Model: positions resized per
grid as Siglip2VisionEmbeddings resizes them; images of every aspect in one padded, masked batch
equal get_image_features, each alone equals the batch; the engine runs images of different grids
with texts in one step, each equal to its reference; what is not supported is refused at load."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from poolserve.engine.loop import Engine
from poolserve.frontend.images import pixel_values
from poolserve.models.dual_encoder import DualEncoderModel
from poolserve.models.loader import load_model
from poolserve.models.spec import LoadedModel
from poolserve.types.errors import ModelLoadError
from poolserve.types.images import ImageInputs
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.tiny_images import SIGLIP2_TEXT_TOKENS, Reference, save_dual_encoder

CPU = torch.device("cpu")
# (height, width) in pixels: wide, tall, square, tiny and strips; grids from 1x24 to 24x1
SIZES = [(40, 24), (24, 40), (64, 64), (1, 1), (5, 300), (300, 7), (17, 200), (54, 50), (9, 31)]
TEXTS = ["w1 w2 w3", "A Photo Of W40", "w5 w7 w9 w11 w13 w2"]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= 1e-4 * float(np.abs(want).max())


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dual_encoder("siglip2", tmp_path_factory.mktemp("siglip2"))


@pytest.fixture(scope="module")
def reference(directory: Path) -> Reference:
    return Reference(directory, "siglip2")


@pytest.fixture(scope="module")
def loaded(directory: Path) -> Iterator[LoadedModel]:
    yield load_model(str(directory), device=CPU)


@pytest.fixture(scope="module")
def pictures() -> list[Image.Image]:
    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def _pixels(loaded: LoadedModel, pictures: list[Image.Image]) -> list[np.ndarray]:
    inputs = cast("ImageInputs", loaded.images)
    return [pixel_values(p, inputs.processing) for p in pictures]


def _embed(loaded: LoadedModel, arrays: list[np.ndarray]) -> np.ndarray:
    batched, grids = cast("ImageInputs", loaded.images).batch(arrays)
    model = cast("DualEncoderModel", loaded.model)
    return model.embed_images(torch.from_numpy(batched), grids).numpy()


def test_positions_are_resized_as_transformers_resizes_them(
    loaded: LoadedModel, reference: Reference
) -> None:
    embeddings = reference.model.vision_model.embeddings
    side = embeddings.position_embedding_size
    table = embeddings.position_embedding.weight.detach().reshape(side, side, -1)
    naflex = cast("DualEncoderModel", loaded.model).vision.naflex
    assert naflex is not None
    for grid in [(1, 24), (24, 1), (4, 4), (2, 12), (6, 4), (3, 8), (1, 1), (5, 5)]:
        want = embeddings.resize_positional_embeddings(
            table, torch.tensor([grid]), grid[0] * grid[1]
        )
        got = naflex.positions(grid)
        assert torch.allclose(got, want[0], atol=1e-6), grid


def test_mixed_aspects_in_one_batch_equal_get_image_features(
    loaded: LoadedModel, reference: Reference, pictures: list[Image.Image]
) -> None:
    arrays = _pixels(loaded, pictures)
    grids = {a.shape[:2] for a in arrays}
    assert len(grids) >= 6  # the batch really mixes grids (and so padding lengths)
    want = reference.images(pictures)
    _close(_embed(loaded, arrays), want)
    for index, array in enumerate(arrays):  # each alone: no padding at all
        _close(_embed(loaded, [array])[0], want[index])


def test_images_of_different_grids_and_texts_in_one_engine_step(
    loaded: LoadedModel, reference: Reference, pictures: list[Image.Image]
) -> None:
    steps: list[int] = []

    class Steps:
        def __getattr__(self, name: str) -> object:
            return lambda *args, **kwargs: steps.append(args[0]) if name == "on_step" else None

    tokenizer = reference.tokenizer
    texts = [
        tokenizer(t, padding="max_length", max_length=SIGLIP2_TEXT_TOKENS)["input_ids"]
        for t in TEXTS
    ]
    arrays = _pixels(loaded, pictures)
    inputs = cast("ImageInputs", loaded.images)
    prompts = [*texts, *(inputs.prompt().tolist() for _ in arrays)]
    pixels = [*(None for _ in texts), *arrays]
    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32)

    async def run() -> list[np.ndarray]:
        engine = Engine(loaded, config, CPU, observer=Steps())  # type: ignore[arg-type]
        engine.start()
        try:
            params = PoolingParams(task=PoolingTask.EMBED, normalize=False)
            futures = engine.submit_many(prompts, params, pixels=pixels)
            return [np.asarray(out.data) for out in await asyncio.gather(*futures)]
        finally:
            await engine.stop()

    got = asyncio.run(run())
    assert len(steps) == 1  # every text and image in one step
    _close(np.stack(got[: len(texts)]), reference.texts(TEXTS))
    _close(np.stack(got[len(texts) :]), reference.images(pictures))


def test_the_tokenizer_lowercases_and_gives_ids_alone(reference: Reference) -> None:
    """Siglip2Tokenizer's own normalizer lowercases (the server tokenizes through it); Google's
    checkpoints' tokenizers give no attention mask, so the padded texts run unmasked."""
    upper, lower = reference.tokenizer(["A Photo Of W40"]), reference.tokenizer(["a photo of w40"])
    assert upper["input_ids"] == lower["input_ids"]
    assert "attention_mask" not in upper


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(directory, target)
    return target


def _edit(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("file", "changes", "said"),
    [
        ("preprocessor_config.json", {"do_resize": False}, "do_resize false"),
        ("preprocessor_config.json", {"patch_size": 8}, "8-pixel patches; the tower takes 4"),
        ("tokenizer_config.json", {"padding_side": "left"}, "pads on the left"),
    ],
)
def test_what_is_not_supported_is_refused_at_load(
    directory: Path, tmp_path: Path, file: str, changes: dict[str, object], said: str
) -> None:
    copy = _copy(directory, tmp_path)
    _edit(copy / file, **changes)
    with pytest.raises(ModelLoadError, match=said):
        load_model(str(copy), device=CPU)


@pytest.mark.parametrize(
    ("changes", "said"),
    [({"vision_use_head": False}, "without its pooling head"), ({"num_channels": 1}, "1 channels")],
)
def test_an_image_tower_it_cannot_run_is_refused(
    directory: Path, tmp_path: Path, changes: dict[str, object], said: str
) -> None:
    copy = _copy(directory, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"].update(changes)
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=said):
        load_model(str(copy), device=CPU)


def test_the_config_and_processor_agree_with_transformers(directory: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(directory)
    assert type(config).__name__ == "Siglip2Config"
    assert transformers.AutoTokenizer.from_pretrained(directory).padding_side == "right"
