"""LoRA adapters mixed in one step against the base model alone, same engine settings, same run.

Run from the repository root: `python -m bench lora [--quick]`. all-MiniLM-L6-v2 (real weights)
is the base; 16 random rank-16 PEFT adapters on every attention and MLP projection are saved by
PEFT itself. The corpus texts (bench/common/corpus.py, up to 128 tokens) are embedded as 16
concurrent requests: all for the base model; then spread uniformly over 1, 4 and 16 adapters, so
every step mixes as many adapters as it can. Each row keeps its fastest of the passes. Prints
markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch

from bench.common.corpus import build_texts
from poolserve.offline import AsyncPoolingEngine
from tests.tiny_models import minilm_path

RANK = 16
TARGETS = ["query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense"]
MIXES = (1, 4, 16)  # adapters the requests are spread over
REQUESTS = 16  # concurrent requests per pass
SIZES = {"quick": (512, 2), "full": (2_048, 3)}  # texts, passes


def _save_adapters(directory: Path, count: int) -> list[str]:
    """`count` random PEFT adapters of MiniLM, as --lora-modules entries."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    entries = []
    for index in range(count):
        base = AutoModel.from_pretrained(minilm_path())
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS))
        gen = torch.Generator().manual_seed(index)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        folder = directory / f"adapter-{index}"
        model.save_pretrained(folder)
        entries.append(f"adapter-{index}={folder}")
    return entries


async def _pass(engine: AsyncPoolingEngine, texts: list[str], names: list[str | None]) -> float:
    """Seconds to embed `texts` as REQUESTS concurrent requests, request i for names[i % n]."""
    size = -(-len(texts) // REQUESTS)
    pieces = [texts[i : i + size] for i in range(0, len(texts), size)]
    start = time.perf_counter()
    await asyncio.gather(
        *(engine.embed(piece, model=names[i % len(names)]) for i, piece in enumerate(pieces))
    )
    return time.perf_counter() - start


async def _measure(entries: list[str], texts: list[str], passes: int) -> dict[str, float]:
    rows: dict[str, float] = {}
    settings = {"lora_modules": entries, "max_loras": len(entries), "max_lora_rank": RANK}
    async with AsyncPoolingEngine(str(minilm_path()), **settings) as engine:
        await _pass(engine, texts[:64], [None])  # warm
        cases: dict[str, list[str | None]] = {"base model alone": [None]}
        for mix in MIXES:
            cases[f"{mix} adapter{'s' if mix > 1 else ''} mixed"] = [
                f"adapter-{i}" for i in range(mix)
            ]
        for _ in range(passes):  # rows take turns, so a slow moment hits them all alike
            for label, names in cases.items():
                seconds = await _pass(engine, texts, names)
                rows[label] = min(rows.get(label, float("inf")), seconds)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer texts and passes")
    args = parser.parse_args(argv)
    num_texts, passes = SIZES["quick" if args.quick else "full"]
    texts = build_texts(minilm_path(), num_texts, seed=0, max_length=128).texts
    with tempfile.TemporaryDirectory() as tmp:
        entries = _save_adapters(Path(tmp), max(MIXES))
        rows = asyncio.run(_measure(entries, texts, passes))
    base = rows["base model alone"]
    print(f"{num_texts} texts as {REQUESTS} concurrent requests, rank-{RANK} adapters\n")
    print("| requests for | texts/s | vs base model |")
    print("|---|---:|---:|")
    for label, seconds in rows.items():
        print(f"| {label} | {num_texts / seconds:,.0f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
