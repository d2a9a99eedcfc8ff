"""Images on the CPU: poolserve's engine vs transformers' CLIP, same images, same process.

Run from the repository root: `python -m bench images [--quick]`. A CLIP ViT-B/32-geometry
checkpoint (transformers' CLIPConfig defaults: image tower 768 wide, 12 layers, 224 px in 32 px
patches; text tower 512 wide, 12 layers; random weights) embeds random images of varied sizes,
preprocessed by the checkpoint's processor outside the timing. Rows, each the fastest of its
passes, taking turns:
- transformers: `get_image_features` in batches of 32 (the reference, in eager PyTorch);
- poolserve: the engine (`Engine.submit_many` with pixel values), all images at once, its steps
  batching them under the token budget;
- poolserve mixed: the same images with as many short texts, submitted together (images and
  texts share steps).
Prints markdown with the worst relative difference from transformers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from PIL import Image

from bench.common.timing import fastest
from poolserve.engine.loop import Engine
from poolserve.frontend.images import pixel_values
from poolserve.models.cpu_class import cpu_class
from poolserve.models.loader import load_model
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from tests.tiny_models import write_tokenizer

SIZES = {"quick": (32, 2), "full": (128, 3)}  # images, passes
BATCH = 32
CPU = torch.device("cpu")


def _save_clip(directory: Path) -> Path:
    """CLIP ViT-B/32's geometry with random weights, its processor, a word-level tokenizer."""
    torch.manual_seed(0)
    config = transformers.CLIPConfig(text_config={"vocab_size": 30522}, vision_config={})
    transformers.CLIPModel(config).save_pretrained(directory)
    transformers.CLIPImageProcessorPil().save_pretrained(directory)
    write_tokenizer(directory)
    return directory


def _images(count: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (200 + 17 * (i % 9), 260, 3), dtype=np.uint8))
        for i in range(count)
    ]


async def _engine_run(
    engine: Engine, pixels: list[np.ndarray], texts: list[list[int]]
) -> np.ndarray:
    images = engine.loaded.images
    assert images is not None
    prompts = [images.prompt() for _ in pixels] + texts
    params = PoolingParams(task=PoolingTask.EMBED, normalize=False)
    futures = engine.submit_many(prompts, params, pixels=[*pixels, *([None] * len(texts))])
    outputs = [await engine.wait(f) for f in futures]
    return np.stack([o.data for o in outputs[: len(pixels)]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench images", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer images and passes")
    args = parser.parse_args(argv)
    count, passes = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        directory = _save_clip(Path(tmp))
        reference = transformers.CLIPModel.from_pretrained(directory).eval()
        processor = transformers.CLIPImageProcessorPil.from_pretrained(directory)
        loaded = load_model(str(directory), device=CPU, dtype=torch.float32)
    assert loaded.images is not None
    pictures = _images(count)
    pixels = [pixel_values(p, loaded.images.processing) for p in pictures]
    batch = torch.from_numpy(np.stack(pixels))
    texts = [[101, *range(1000 + i, 1012 + i), 102] for i in range(count)]

    def peer() -> np.ndarray:
        with torch.inference_mode():
            parts = [
                reference.get_image_features(pixel_values=batch[i : i + BATCH]).pooler_output
                for i in range(0, count, BATCH)
            ]
        return torch.cat(parts).numpy()

    loop = asyncio.new_event_loop()
    config = SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=256)
    engine = Engine(loaded, config, CPU)
    loop.run_until_complete(_start(engine))
    rows = []
    for name, run in (
        ("transformers get_image_features (batch 32)", peer),
        (
            "poolserve engine: images",
            lambda: loop.run_until_complete(_engine_run(engine, pixels, [])),
        ),
        (
            "poolserve engine: images + as many texts",
            lambda: loop.run_until_complete(_engine_run(engine, pixels, texts)),
        ),
    ):
        seconds, out = fastest(run, passes)
        rows.append((name, seconds, out))
    loop.run_until_complete(engine.stop())
    want = np.asarray(processor(images=pictures, return_tensors="np")["pixel_values"])
    assert np.array_equal(want, batch.numpy())  # the front end's pixels are the processor's
    base = rows[0][1]
    threads = torch.get_num_threads()
    print(f"CLIP ViT-B/32 geometry, {count} images, float32, {threads} threads, {cpu_class()}")
    print("| runtime | images/s | vs transformers | worst rel. diff |")
    print("|---|---:|---:|---:|")
    for name, seconds, out in rows:
        diff = float(np.abs(out - rows[0][2]).max() / np.abs(rows[0][2]).max())
        print(f"| {name} | {count / seconds:,.1f} | {base / seconds:.2f}x | {diff:.1e} |")


async def _start(engine: Engine) -> None:
    engine.start()
