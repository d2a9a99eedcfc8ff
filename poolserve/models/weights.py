"""Reads safetensors checkpoints (single or sharded) and refuses pickle weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from poolserve.types.errors import ModelLoadError, UnsafeCheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the single file, or every shard of the index."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"malformed {INDEX_FILE}: {exc}") from exc
        shards = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise ModelLoadError(f"missing safetensors shards: {', '.join(missing)}")
        return shards
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise UnsafeCheckpointError(
            f"only pickle weights found ({', '.join(pickles)}); "
            "pickle can run arbitrary code, convert the checkpoint to safetensors"
        )
    raise ModelLoadError(f"no safetensors weights in {directory}")


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, on the CPU, keyed as saved."""
    state: dict[str, torch.Tensor] = {}
    for path in safetensors_files(directory):
        try:
            state.update(load_file(str(path), device="cpu"))
        except Exception as exc:  # safetensors raises its own untyped errors for corrupt files
            raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc
    return state


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix`, with the prefix removed."""
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def take(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """One required tensor; a missing one is a load error naming it."""
    try:
        return state[key]
    except KeyError:
        raise ModelLoadError(f"checkpoint lacks tensor {key!r}") from None
