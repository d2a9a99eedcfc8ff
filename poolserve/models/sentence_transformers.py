"""Reads sentence-transformers files: modules.json, the model config, Pooling, Dense."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from poolserve.models.weights import load_state_dict
from poolserve.types.errors import ModelLoadError
from poolserve.types.model import SentenceTransformersConfig

MODULES_FILE = "modules.json"
# Written by sentence-transformers beside modules.json: prompts, default prompt, similarity function
MODEL_CONFIG_FILE = "config_sentence_transformers.json"
# sentence-transformers reads the first of these it finds in its Transformer module's folder
TRANSFORMER_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
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


def _input_config(directory: Path) -> tuple[int | None, bool]:
    """max_seq_length and do_lower_case of the Transformer module; (None, False) without a file."""
    found = [directory / name for name in TRANSFORMER_CONFIG_FILES if (directory / name).is_file()]
    if not found:
        return None, False
    config = _read_json(found[0])
    length = config.get("max_seq_length")
    # bool is an int in Python; a JSON true is no length
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int) or length < 1
    ):
        raise ModelLoadError(f"{found[0].name}: max_seq_length must be a positive integer")
    return length, bool(config.get("do_lower_case", False))


def _dense(directory: Path, device: torch.device) -> torch.nn.Module:
    """One Dense module: Linear plus its activation, float32 on the model's device."""
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
    return torch.nn.Sequential(linear, _ACTIVATIONS[name]()).float().eval().to(device)


def _prompts(config: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """The named prompts, each a string (sentence-transformers turns a null prompt into "")."""
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict):
        raise ModelLoadError(f"{MODEL_CONFIG_FILE}: prompts must be an object")
    bad = [name for name, text in prompts.items() if text is not None and not isinstance(text, str)]
    if bad:
        raise ModelLoadError(f"{MODEL_CONFIG_FILE}: prompt {bad[0]!r} must be a string")
    return tuple((str(name), text or "") for name, text in prompts.items())


def _optional(config: dict[str, Any], key: str, kind: type) -> Any:
    """One optional field of the model config, checked for its JSON type."""
    value = config.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise ModelLoadError(f"{MODEL_CONFIG_FILE}: {key} must be a {kind.__name__}")
    return value


def _model_config(directory: Path) -> dict[str, Any]:
    """config_sentence_transformers.json, checked: prompts, default prompt, truncate_dim."""
    path = directory / MODEL_CONFIG_FILE
    config = _read_json(path) if path.is_file() else {}
    if not isinstance(config, dict):
        raise ModelLoadError(f"{MODEL_CONFIG_FILE} must hold a JSON object")
    prompts = _prompts(config)
    default = _optional(config, "default_prompt_name", str)
    if default is not None and default not in dict(prompts):
        # sentence-transformers refuses such a model at load as well
        raise ModelLoadError(
            f"{MODEL_CONFIG_FILE}: default_prompt_name {default!r} is not a prompt"
        )
    truncate_dim = _optional(config, "truncate_dim", int)
    if truncate_dim is not None and truncate_dim < 1:
        raise ModelLoadError(f"{MODEL_CONFIG_FILE}: truncate_dim must be positive")
    return {
        "prompts": prompts,
        "default_prompt_name": default,
        "similarity_fn_name": _optional(config, "similarity_fn_name", str),
        "truncate_dim": truncate_dim,
    }


def read_sentence_transformers(
    directory: Path, device: torch.device
) -> SentenceTransformersConfig | None:
    """The sentence-transformers config of a checkpoint, None without modules.json."""
    if not (directory / MODULES_FILE).is_file():
        return None
    paths: dict[str, list[Path]] = {}  # module kind -> folders, in modules.json order
    for module in _read_json(directory / MODULES_FILE):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        paths.setdefault(kind, []).append(directory / str(module.get("path", "")))
    pooling = paths.get("Pooling", [])
    dense = [_dense(path, device) for path in paths.get("Dense", [])]
    max_seq_length, do_lower_case = _input_config(paths.get("Transformer", [directory])[0])
    pooling_config = _read_json(pooling[-1] / "config.json") if pooling else {}
    return SentenceTransformersConfig(
        pooling_mode=_pooling_mode(pooling_config) if pooling else None,
        dense=torch.nn.Sequential(*dense) if dense else None,
        normalize="Normalize" in paths,
        max_seq_length=max_seq_length,
        do_lower_case=do_lower_case,
        include_prompt=bool(pooling_config.get("include_prompt", True)),
        **_model_config(directory),
    )
