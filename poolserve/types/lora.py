"""LoRA adapters served on a base model: each one's name, where it lies, and the flags' limits.

Torch-free: the settings parse `--lora-modules` into these records, the engine core loads them,
and the model card carries them to the front ends, which route a request's `model` to them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# vLLM's --max-lora-rank default
DEFAULT_MAX_LORA_RANK = 16


@dataclass(frozen=True)
class LoraModule:
    """One adapter: the name requests send as `model`, its PEFT folder (or Hub id), and the
    base model it was trained on as a served name (None: the model it is given to)."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoraServing:
    """A model's adapters and the room kept for them (--max-loras, --max-lora-rank)."""

    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1  # adapters held at once: the stacked slots of every adapted projection
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK


def parse_lora_module(item: Any) -> LoraModule:
    """vLLM's two forms: `name=path`, or a JSON object {"name", "path", "base_model_name"}."""
    if isinstance(item, dict):
        return _from_object(item)
    if not isinstance(item, str):
        raise ValueError(f"expected name=path or a JSON object, got {type(item).__name__}")
    text = item.strip()
    if text.startswith("{"):
        return _from_object(json.loads(text))
    name, equals, path = text.partition("=")
    if not equals or not name.strip() or not path.strip():
        raise ValueError(f"{text!r} is not name=path")
    return LoraModule(name.strip(), path.strip())


def _from_object(value: Any) -> LoraModule:
    """A JSON adapter entry: name and path required, base_model_name optional, nothing else."""
    if not isinstance(value, dict):
        raise ValueError("a JSON adapter entry must be an object")
    unknown = set(value) - {"name", "path", "base_model_name"}
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}: name, path, base_model_name are read")
    name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError("an adapter entry needs a name and a path (non-empty strings)")
    if base is not None and not isinstance(base, str):
        raise ValueError("base_model_name must be a string")
    return LoraModule(name, path, base)
