"""Vision-language embeddings on the CPU: poolserve's engine vs transformers' Qwen2-VL, same
prompts, same process.

Run from the repository root: `python -m bench vision-language [--quick] [--layers N]`. A
checkpoint of Qwen2-VL-2B's widths (vision tower 1280 wide, 16 heads, 14 px patches, merger to
1536; decoder 1536 wide, 12 heads, 2 KV heads, MLP 8960) with fewer layers (`--layers`, default
4 of each; the model's 32 and 28 take minutes a prompt on two cores), random weights. Each
prompt is a user message of one image (448 x 336 px: 768 patches, 192 tokens) and a sentence,
rendered by Qwen2-VL's chat template, its image preprocessed by the checkpoint's processor
outside the timing. Rows, each the fastest of its passes, taking turns:
- transformers: `Qwen2VLModel` one prompt at a time (its batch pads; the last token's state);
- poolserve: the engine (`Engine.submit_many` with each prompt's images), all prompts at once,
  whole prompts in its steps (a budget of 4096 tokens);
- poolserve chunked: the same with a budget of 128 tokens (every image split over chunks).
The engines run without the prefix cache: each pass embeds the same prompts, which it would
otherwise find cached.
Prints markdown with the worst relative difference from transformers; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common.timing import fastest
from poolserve.engine.loop import Engine
from poolserve.models.cpu_class import cpu_class
from poolserve.models.loader import load_model
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import PoolingTask
from poolserve.types.vision import PromptImages
from tests.tiny_vl import IMAGE_TOKEN, Reference, image, save_tiny_vl

SIZES = {"quick": (4, 2), "full": (16, 3)}  # prompts, passes
CPU = torch.device("cpu")
IMAGE_SIZE = (448, 336)  # width, height: 32 x 24 patches, 192 tokens after the 2 x 2 merge


def _geometry(layers: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Qwen2-VL-2B's widths with `layers` layers in each tower, and its processor's pixels
    capped so that a 448 x 336 image keeps its size."""
    rope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
    text = {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": layers,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "rope_parameters": rope,
    }
    vision = {"depth": layers, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16}
    return text, {**vision, "mlp_ratio": 4}, {"min_pixels": 28 * 28, "max_pixels": 448 * 448}


def _config(budget: int) -> SchedulerConfig:
    """A step of `budget` tokens; no prefix cache (every pass but the first would find every
    prompt cached, images included: the cache's own gain is not what this measures)."""
    return SchedulerConfig(
        max_num_batched_tokens=budget, max_num_seqs=64, enable_prefix_caching=False
    )


async def _engine_run(
    engine: Engine, prompts: list[np.ndarray], media: list[PromptImages]
) -> np.ndarray:
    params = PoolingParams(task=PoolingTask.EMBED, normalize=False)
    futures = engine.submit_many(list(prompts), params, media=list(media))
    return np.stack([(await engine.wait(f)).data for f in futures])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench vision-language", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer prompts and passes")
    parser.add_argument("--layers", type=int, default=4, help="layers of each tower")
    args = parser.parse_args(argv)
    count, passes = SIZES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        directory = save_tiny_vl("qwen2_vl", Path(tmp), geometry=_geometry(args.layers))
        reference = Reference(directory)
        loaded = load_model(str(directory), device=CPU, dtype=torch.float32)
    texts = [f"w{i} w{i + 1} w{i + 2} Describe" for i in range(count)]
    pictures = [image(*IMAGE_SIZE, seed=i) for i in range(count)]
    rendered = [
        reference.render(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}]
        )
        for t in texts
    ]
    inputs = [
        reference.inputs(text, [picture]) for text, picture in zip(rendered, pictures, strict=True)
    ]
    prompts = [ids[0].numpy() for ids, _ in inputs]
    media = [
        PromptImages(
            (extra["pixel_values"].float().numpy(),),
            (tuple(int(v) for v in extra["image_grid_thw"][0].tolist()),),  # type: ignore[arg-type]
        )
        for _, extra in inputs
    ]

    def peer() -> np.ndarray:
        rows = []
        with torch.inference_mode():
            for ids, extra in inputs:
                types = (ids == IMAGE_TOKEN).int()
                out = reference.model.model(input_ids=ids, mm_token_type_ids=types, **extra)
                rows.append(out.last_hidden_state[0, -1])
        return torch.stack(rows).numpy()

    loop = asyncio.new_event_loop()
    engines = {budget: Engine(loaded, _config(budget), CPU) for budget in (4096, 128)}
    for engine in engines.values():
        loop.run_until_complete(_start(engine))
    rows = []
    for name, run in (
        ("transformers Qwen2VLModel (one prompt at a time)", peer),
        (
            "poolserve engine: whole prompts (budget 4096)",
            lambda: loop.run_until_complete(_engine_run(engines[4096], prompts, media)),
        ),
        (
            "poolserve engine: chunked (budget 128)",
            lambda: loop.run_until_complete(_engine_run(engines[128], prompts, media)),
        ),
    ):
        seconds, out = fastest(run, passes)
        rows.append((name, seconds, out))
    for engine in engines.values():
        loop.run_until_complete(engine.stop())
    base = rows[0][1]
    threads = torch.get_num_threads()
    tokens = sum(len(p) for p in prompts)
    print(
        f"Qwen2-VL-2B widths, {args.layers} layers a tower, {count} prompts of one "
        f"{IMAGE_SIZE[0]}x{IMAGE_SIZE[1]} image ({tokens} tokens), float32, {threads} threads, "
        f"{cpu_class()}"
    )
    print("| runtime | prompts/s | vs transformers | worst rel. diff |")
    print("|---|---:|---:|---:|")
    for name, seconds, out in rows:
        diff = float(np.abs(out - rows[0][2]).max() / np.abs(rows[0][2]).max())
        print(f"| {name} | {count / seconds:,.2f} | {base / seconds:.2f}x | {diff:.1e} |")


async def _start(engine: Engine) -> None:
    engine.start()
