"""Reads sentence-transformers files: modules.json, 1_Pooling, 2_Dense, Normalize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from models.errors import ModelLoadError
from models.spec import SentenceTransformersConfig
from models.weights import load_state_dict

MODULES_FILE = "modules.json"
# Pooling config flags in the order sentence-transformers itself names the mode.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ACTIVATIONS: dict[str, type[torch.nn.Module]] = {
    "Identity": torch.nn.Identity,
    "Tanh": torch.nn.Tanh,
    "ReLU": torch.nn.ReLU,
    "GELU": torch.nn.GELU,
    "Sigmoid": torch.nn.Sigmoid,
    "SiLU": torch.nn.SiLU,
}


def _read_json(path: Path) -> Any:
    """Parses one JSON file, with a load error naming it."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name}: {exc}") from exc


def _pooling_mode(config: dict[str, Any]) -> str | None:
    """The pooling mode from an explicit `pooling_mode` or the first set flag."""
    if isinstance(config.get("pooling_mode"), str):
        return str(config["pooling_mode"])
    modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    return modes[0] if modes else None


def _dense(directory: Path) -> torch.nn.Module:
    """One Dense module: Linear plus its activation, float32."""
    config = _read_json(directory / "config.json")
    name = str(config.get("activation_function", "Identity")).rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"unsupported Dense activation {name!r}")
    linear = torch.nn.Linear(
        int(config["in_features"]), int(config["out_features"]), bias=bool(config.get("bias", True))
    )
    state = {k.removeprefix("linear."): v for k, v in load_state_dict(directory).items()}
    try:
        linear.load_state_dict(state)
    except RuntimeError as exc:
        raise ModelLoadError(f"Dense weights in {directory.name} do not fit: {exc}") from exc
    return torch.nn.Sequential(linear, _ACTIVATIONS[name]()).float().eval()


def read_sentence_transformers(directory: Path) -> SentenceTransformersConfig | None:
    """The sentence-transformers config of a checkpoint, None without modules.json."""
    if not (directory / MODULES_FILE).is_file():
        return None
    pooling_mode: str | None = None
    dense: list[torch.nn.Module] = []
    normalize = False
    for module in _read_json(directory / MODULES_FILE):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = directory / str(module.get("path", ""))
        if kind == "Pooling":
            pooling_mode = _pooling_mode(_read_json(path / "config.json"))
        elif kind == "Dense":
            dense.append(_dense(path))
        elif kind == "Normalize":
            normalize = True
    chained = torch.nn.Sequential(*dense) if dense else None
    return SentenceTransformersConfig(pooling_mode=pooling_mode, dense=chained, normalize=normalize)
