"""Several models behind one server: which models, and each one's settings.

`poolserve serve A B` serves A and B with the server's flags; `--models-config FILE` (YAML) gives
each model its own settings, the server-wide flags being the defaults:

    default_model: minilm            # optional; else --default-model, else the first model
    models:
      - model: sentence-transformers/all-MiniLM-L6-v2
        served_model_name: [minilm, embedder]
        pooler_config: {normalize: true}
      - model: BAAI/bge-reranker-base
        served_model_name: reranker
        max_model_len: 512
        token_budget_share: 0.5      # half of --max-num-batched-tokens per step
        priority: -1                 # steps first when both wait for the device

A model entry takes the per-model settings (`PER_MODEL`, the flags' names) and three keys of
its own; anything else is refused at start, naming the model and the key. Each model's
settings become a whole `ServerSettings` (the server's, its entry's keys over them), so
everything downstream of one model is the single-model code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from poolserve.config.pooler import PoolerDefaults, parse_pooler_config
from poolserve.config.settings import PER_MODEL, ServerSettings
from poolserve.types.model import DEFAULT_MODEL_ID

# Settings that name the models themselves: never copied into one model's settings.
MODEL_LIST = ("models", "models_config", "default_model")
# Settings given as JSON text on the command line, which a YAML file may give as a mapping.
JSON_TEXT = frozenset({"pooler_config", "hf_overrides"})


class ModelsConfigError(ValueError):
    """The models (from the flags or the models file) cannot be served as given."""


class _Entry(BaseModel):
    """One model of the models file: its own keys; the per-model settings are checked apart."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str | None = None
    priority: int = Field(0, ge=-1000, le=1000)
    token_budget_share: float | None = Field(None, gt=0.0, le=1.0)
    gpu_memory_fraction: float | None = Field(None, gt=0.0, le=1.0)


class _File(BaseModel):
    """The models file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: list[_Entry] = Field(min_length=1)
    default_model: str | None = None


@dataclass(frozen=True)
class ServedModel:
    """One model to serve: its whole settings, and how it shares the device with the others."""

    settings: ServerSettings  # the server's, with this model's own keys over them
    name: str  # the name responses report (the first served name)
    priority: int = 0  # among models waiting for the device, the lower steps first
    gpu_memory_fraction: float | None = None  # of the device's memory (CUDA); None: no cap

    @cached_property
    def pooler(self) -> PoolerDefaults:
        """Its --pooler-config, parsed once (ValueError naming the model and the key)."""
        try:
            return parse_pooler_config(self.settings.pooler_config)
        except ValueError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from exc

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's `model` may use for it."""
        return self.settings.served_model_names or (self.name,)


@dataclass(frozen=True)
class ServedModels:
    """Every model of the server, in order, and the one routes without `model` use."""

    models: tuple[ServedModel, ...]
    default: ServedModel


def default_name(model: str | None) -> str:
    """The name a model is served as without --served-model-name or NAME=: never a filesystem
    path; a local folder's name as given (a symlink's own, not its target's)."""
    if model is None:
        return DEFAULT_MODEL_ID
    local = Path(model).expanduser()
    if not local.is_dir():
        return model
    return local.name or local.resolve().name  # "." and ".." have no name of their own


def named_model(argument: str) -> tuple[str | None, str]:
    """`NAME=PATH` (or `NAME=HUB_ID`) names a model on the command line, as vLLM's
    --served-model-name does for one; a plain path or id has no name of its own."""
    name, sep, model = argument.partition("=")
    if not sep or Path(argument).expanduser().exists():  # a folder may hold "=" in its name
        return None, argument
    if not name or not model:
        raise ModelsConfigError(f"{argument!r}: NAME=MODEL needs both a name and a model")
    return name, model


def served_models(settings: ServerSettings) -> ServedModels:
    """The models the settings name, each with its settings; refused clearly if they clash."""
    if settings.models_config is not None:
        if settings.models or settings.model is not None:
            raise ModelsConfigError(
                "give the models either as arguments (--model, --models) or in "
                "--models-config, not both"
            )
        parsed = _read(settings.models_config)
        entries, default = parsed.models, parsed.default_model or settings.default_model
        models = tuple(_from_entry(settings, entry, i) for i, entry in enumerate(entries))
    else:
        arguments = (settings.model, *(settings.models or ()))
        models = tuple(_named(settings, argument, i) for i, argument in enumerate(arguments))
        default = settings.default_model
    _check_names(models)
    _check_fractions(models)
    return ServedModels(models, _default(models, default))


def _read(path: str) -> _File:
    """The models file parsed and its structure checked."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelsConfigError(f"--models-config: cannot read {path!r}: {exc.strerror}") from exc
    import yaml  # only with --models-config

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ModelsConfigError(f"--models-config {path}: not YAML: {exc}") from exc
    try:
        return _File.model_validate(data)
    except ValidationError as exc:
        raise ModelsConfigError(f"--models-config {path}: {_problems(exc)}") from exc


def _from_entry(settings: ServerSettings, entry: _Entry, index: int) -> ServedModel:
    """A file entry's model: its keys checked, then its settings over the server's."""
    where = f"--models-config: models[{index}] ({entry.model or DEFAULT_MODEL_ID})"
    extra = dict(entry.model_extra or {})
    for key in extra:
        if key in PER_MODEL:
            continue
        kind = "a server-wide setting" if key in ServerSettings.model_fields else "not a setting"
        raise ModelsConfigError(f"{where}: {key!r} is {kind}; a model may set {_keys()}")
    overrides: dict[str, Any] = {"model": entry.model, **extra}
    for key in JSON_TEXT & overrides.keys():
        if isinstance(overrides[key], dict):  # YAML's mapping for the flag's JSON text
            overrides[key] = json.dumps(overrides[key])
    if entry.token_budget_share is not None and "max_num_batched_tokens" not in extra:
        budget = settings.max_num_batched_tokens
        overrides["max_num_batched_tokens"] = max(1, round(entry.token_budget_share * budget))
    served = _one(settings, overrides, where)
    return ServedModel(served.settings, served.name, entry.priority, entry.gpu_memory_fraction)


def _named(settings: ServerSettings, argument: str | None, index: int) -> ServedModel:
    """A model given as an argument (`--model`, `--models`, `poolserve serve A B`), named by
    `NAME=` when it says so; --served-model-name names the first model otherwise."""
    if argument is None:
        return _one(settings, {"model": None}, None)
    name, model = named_model(argument)
    if name is None:
        return _one(settings, {"model": model}, model)
    if index == 0 and settings.served_model_name:
        raise ModelsConfigError(
            f"{argument!r}: the model is named twice, by NAME= and by --served-model-name: "
            "give one of them"
        )
    return _one(settings, {"model": model, "served_model_name": [name]}, model)


def _one(settings: ServerSettings, overrides: dict[str, Any], where: str | None) -> ServedModel:
    """One model's whole settings: the server's with `overrides` over them, validated."""
    values = {k: v for k, v in settings.model_dump().items() if k not in MODEL_LIST}
    try:
        # every field given: the environment was read once, for the server's settings
        merged = ServerSettings(**{**values, **overrides})
    except ValidationError as exc:
        label = where or "the model"
        raise ModelsConfigError(f"{label}: {_problems(exc)}") from exc
    names = merged.served_model_names or (default_name(merged.model),)
    return ServedModel(merged, names[0])


def _check_names(models: tuple[ServedModel, ...]) -> None:
    """No served name (or alias) belongs to two models."""
    owner: dict[str, str] = {}
    for served in models:
        for name in served.served_names:
            if name in owner:
                raise ModelsConfigError(
                    f"two models are served as {name!r} ({owner[name]!r} and "
                    f"{served.settings.model or DEFAULT_MODEL_ID!r}): give each its own "
                    "served_model_name"
                )
            owner[name] = served.settings.model or DEFAULT_MODEL_ID


def _check_fractions(models: tuple[ServedModel, ...]) -> None:
    """Device memory fractions that can all hold at once."""
    total = sum(m.gpu_memory_fraction or 0.0 for m in models)
    if total > 1.0 + 1e-9:
        raise ModelsConfigError(
            f"the models' gpu_memory_fraction add up to {total:.3g}, more than the whole device"
        )


def _default(models: tuple[ServedModel, ...], name: str | None) -> ServedModel:
    """The model named (by any of its names), else the first."""
    if name is None:
        return models[0]
    for served in models:
        if name in served.served_names:
            return served
    known = ", ".join(repr(n) for m in models for n in m.served_names)
    raise ModelsConfigError(f"--default-model {name!r} is none of the served models ({known})")


def _keys() -> str:
    """The keys a model entry takes, for error messages."""
    own = ("priority", "token_budget_share", "gpu_memory_fraction")
    return ", ".join(sorted(PER_MODEL | set(own)))


def _problems(exc: ValidationError) -> str:
    """pydantic's errors on one line, each naming its key."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )
