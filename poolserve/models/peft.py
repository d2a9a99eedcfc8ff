"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`) on a loaded
model: read, checked against the model's projections, written into its stacked LoRA slots.

Every adapter takes one index of each adapted projection's `LoraLinear` (models/adapters.py); a
step runs each token through its own request's adapter. Each module's scale (PEFT's
`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA; `alpha_pattern` per module) is folded into its B,
and ranks below the slot's room are zero-padded: a zero row adds nothing. What the forward
cannot apply exactly (DoRA, trained biases, embedding tables, modules outside the layers'
projections) is refused with the reason, never skipped: an adapter either changes every module
it trained or does not load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from poolserve.models.adapters import LoraEmbedding, LoraLinear, LoraSite, StackedLora
from poolserve.models.heads import HeadFactory
from poolserve.models.packed import PackedModel
from poolserve.types.errors import LoraAdapterError
from poolserve.types.lora import LoraModule, LoraServing

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_FILE = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")
_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<which>A|B)$")
# PEFT saves an adapted embedding layer's own table beside its LoRA: the model's, unchanged
_BASE_LAYER = ".base_layer.weight"

# adapter_config.json switches the forward cannot apply exactly, with the value it can
_EXACT_ONLY: dict[str, tuple[Any, ...]] = {
    "peft_type": ("LORA",),
    "use_dora": (False, None),  # DoRA rescales the whole weight per column
    "bias": ("none", None),  # trained biases of the base projections
    "lora_bias": (False, None),  # a bias on B
    "fan_in_fan_out": (False, None),  # GPT-2's Conv1D layout
    "layer_replication": (None,),  # layers stacked again
    "use_qalora": (False, None),
    "use_bdlora": (False, None, {}),
    "trainable_token_indices": (None, [], {}),  # new token rows of the embedding table
    "alora_invocation_tokens": (None, []),  # activated LoRA: from a token on only
}


@dataclass(frozen=True)
class ServedAdapters:
    """A model's LoRA serving: its limits and the adapters read at load (--lora-modules)."""

    serving: LoraServing
    adapters: tuple[tuple[LoraModule, PeftAdapter], ...]


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter folder, read: its name, where it lies, each module's A and scaled B."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    # module path (PEFT's, its `base_model.model.` removed) -> (A [r, in], B [out, r] * scale)
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    # whole tensors it replaces (`modules_to_save`: a classifier's), by checkpoint name
    saved: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # embedding-table LoRA: module path -> (A [rows, r], B [r, dim] * scale)
    tables: Mapping[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def read_peft_adapter(name: str, path: Path) -> PeftAdapter:
    """The adapter in folder `path`; LoraAdapterError naming the reason when it cannot load."""
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    linear = _pairs(name, tensors, _LORA_KEY)
    embedding = _pairs(name, tensors, _EMBEDDING_KEY)
    saved = {
        k: t.float()
        for k, t in tensors.items()
        if not (_LORA_KEY.match(k) or _EMBEDDING_KEY.match(k))
    }
    modules = {m: (a, b * _scale(config, m, int(a.shape[0]))) for m, (a, b) in linear.items()}
    # PEFT's embedding LoRA: A [r, rows], B [dim, r]; a row t moves by B @ A[:, t] * scale
    tables = {
        m: (a.t(), (b * _scale(config, m, int(a.shape[0]))).t()) for m, (a, b) in embedding.items()
    }
    if not modules and not tables:
        raise LoraAdapterError(name, f"{WEIGHTS_FILE} holds no LoRA weights")
    rank = max(int(a.shape[0]) for a, _ in (*linear.values(), *embedding.values()))
    return PeftAdapter(name, path, rank, modules, saved, tables)


def _pairs(
    name: str, tensors: Mapping[str, torch.Tensor], pattern: re.Pattern[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each module's (A [r, in], B [out, r]) among the tensors whose key `pattern` matches."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = pattern.match(key)
        if found is not None:
            pairs.setdefault(found["module"], {})[found["which"]] = tensor
    checked = {}
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(name, f"{module} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraAdapterError(
                name, f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not pair"
            )
        checked[module] = (a, b)
    return checked


def _read_config(name: str, path: Path) -> dict[str, Any]:
    """adapter_config.json, with every switch the forward cannot apply exactly refused."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraAdapterError(name, f"{path} has no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraAdapterError(name, f"cannot read {CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraAdapterError(name, f"{CONFIG_FILE} is not a JSON object")
    refused = [
        f"{key}={config[key]!r}"
        for key, exact in _EXACT_ONLY.items()
        if key in config and config[key] not in exact
    ]
    if refused:
        raise LoraAdapterError(name, "not served: " + ", ".join(refused))
    return config


def _read_tensors(name: str, path: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors, PEFT's prefix removed; pickled weights are refused."""
    file = path / WEIGHTS_FILE
    if not file.is_file():
        why = "pickled weights are not loaded" if (path / PICKLED_FILE).is_file() else "none"
        raise LoraAdapterError(name, f"{path} has no {WEIGHTS_FILE} ({why})")
    try:
        with safe_open(str(file), framework="pt") as opened:
            keys = list(opened.keys())
            return {k.removeprefix(PEFT_PREFIX): opened.get_tensor(k) for k in keys}
    except Exception as exc:  # safetensors raises its own untyped errors for corrupt files
        raise LoraAdapterError(name, f"cannot read {WEIGHTS_FILE}: {exc}") from exc


def _pattern_value(patterns: Mapping[str, Any], module: str) -> Any:
    """PEFT's rank_pattern/alpha_pattern lookup: the first key that names the module's tail."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return None


def _scale(config: Mapping[str, Any], module: str, rank: int) -> float:
    """PEFT's scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module)
    if alpha is None:
        alpha = config.get("lora_alpha", 8)  # PEFT's LoraConfig default
    root = math.sqrt(rank) if config.get("use_rslora") else rank
    return float(alpha) / root


def names(module: str, name: str) -> bool:
    """Whether a PEFT module path is the model's module `name` (any head class's prefix before
    it, `bert.` or `model.`)."""
    return module == name or module.endswith(f".{name}")


def site_of(sites: Mapping[str, LoraSite], module: str) -> LoraSite | None:
    """The site of a PEFT module path."""
    return next((site for name, site in sites.items() if names(module, name)), None)


def make_room(
    model: PackedModel,
    max_rank: int,
    capacity: int,
    placement: tuple[torch.device, torch.dtype],
) -> None:
    """Room for `capacity` adapters of rank up to `max_rank` in every projection the model
    adapts, all empty (engine/lora_slots.py writes adapters in and out)."""
    if model.adapter_names:
        raise LoraAdapterError(
            "",
            "the model carries its own task adapters (jina-embeddings-v3); PEFT adapters on it "
            "are not served",
        )
    table = model.word_table()
    if table is not None:
        rows, dim = (int(n) for n in table[1].shape)
        model.set_word_lora(LoraEmbedding.empty(capacity, max_rank, (rows, dim), placement))
    sites = model.lora_sites()
    if not sites:
        raise LoraAdapterError("", f"{type(model).__name__} has no projections to adapt")
    slots = {(s.layer, s.slot): s for s in sites.values()}
    for (layer, slot), site in slots.items():
        model.lora_slots(layer)[slot] = LoraLinear.empty(
            capacity, max_rank, site.parts, site.in_features, placement
        )
    model.adapter_names = ("",) * capacity  # every slot free


Placed = list[tuple[LoraSite, torch.Tensor, torch.Tensor]]
Outside = dict[str, tuple[torch.Tensor, torch.Tensor]]


def place_adapter(
    model: PackedModel, adapter: PeftAdapter, max_rank: int
) -> tuple[Placed, Outside]:
    """Where each LoRA module of the adapter lands in the layers, and the modules outside
    them (a head's); LoraAdapterError for a rank above the room or a shape that does not fit."""
    if adapter.rank > max_rank:
        raise LoraAdapterError(
            adapter.name, f"its rank {adapter.rank} is above --max-lora-rank {max_rank}"
        )
    sites = model.lora_sites()
    placed: Placed = []
    outside: Outside = {}
    for module, (a, b) in adapter.modules.items():
        site = site_of(sites, module)
        if site is None:
            outside[module] = (a, b)
            continue
        out_features = site.parts[site.part]
        if a.shape[1] != site.in_features or b.shape[0] != out_features:
            raise LoraAdapterError(
                adapter.name,
                f"{module} maps {a.shape[1]} -> {b.shape[0]} features where the model's "
                f"projection maps {site.in_features} -> {out_features}",
            )
        placed.append((site, a, b))
    table = model.word_table()
    for module, (a, b) in adapter.tables.items():
        if table is None or not names(module, table[0]):
            raise LoraAdapterError(
                adapter.name, f"{module} is not the model's token embedding table"
            )
        if a.shape[0] != table[1].shape[0] or b.shape[1] != table[1].shape[1]:
            raise LoraAdapterError(
                adapter.name,
                f"{module}'s LoRA is for a table of {a.shape[0]} x {b.shape[1]}, the model's "
                f"is {table[1].shape[0]} x {table[1].shape[1]}",
            )
    return placed, outside


def check_adapter(
    model: PackedModel, adapter: PeftAdapter, max_rank: int, head: HeadFactory | None
) -> torch.nn.Module | None:
    """Checks the adapter fits the model; its own head when it trains the head (None: the
    model's head serves it). LoraAdapterError naming the first misfit."""
    _, outside = place_adapter(model, adapter, max_rank)
    saved = _without_base_tables(model, adapter)
    if not outside and not saved:
        return None
    names = {} if head is None else head.tensors
    example = next(iter(model.lora_sites()))

    def head_key(name: str) -> str:
        key = next((k for k in names if k == name or name.endswith(f".{k}")), None)
        if key is None:
            where = "of its head" if head is not None else "of a head adapters may train"
            raise LoraAdapterError(
                adapter.name,
                f"{name} is not one of the model's layer projections (e.g. {example}) nor a "
                f"tensor {where}",
            )
        return key

    replaced: dict[str, torch.Tensor] = {}
    for name, tensor in saved.items():
        key = head_key(name)
        replaced[key] = _same_shape(adapter.name, key, names[key], tensor)
    for module, (a, b) in outside.items():
        key = head_key(f"{module}.weight")
        weight = replaced.get(key, names[key].float())
        # a head runs once per request: its LoRA merged into the weight is exact and free
        replaced[key] = _same_shape(adapter.name, key, weight, weight + b @ a)
    assert head is not None  # head_key refused every name without one
    return head.build(replaced)


def _without_base_tables(model: PackedModel, adapter: PeftAdapter) -> dict[str, torch.Tensor]:
    """The adapter's saved tensors less the embedding table PEFT saves beside its LoRA, which
    must be the model's own (a changed table is not served)."""
    saved = dict(adapter.saved)
    table = model.word_table()
    for key in [k for k in saved if k.endswith(_BASE_LAYER)]:
        module = key.removesuffix(_BASE_LAYER)
        if table is None or not names(module, table[0]):
            continue  # not the token table: the head's check below names it
        stored = saved.pop(key)
        same = stored.shape == table[1].shape and torch.equal(
            stored.to(device=table[1].device, dtype=table[1].dtype), table[1]
        )
        if not same:
            raise LoraAdapterError(
                adapter.name, f"it replaces the embedding table ({key}): not served"
            )
    return saved


def _same_shape(name: str, key: str, original: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    if original.shape != new.shape:
        raise LoraAdapterError(
            name, f"{key} has shape {list(new.shape)} where the model's has {list(original.shape)}"
        )
    return new


def write_adapter(model: PackedModel, index: int, adapter: PeftAdapter, max_rank: int) -> None:
    """Writes the adapter's layer LoRA as adapter `index` (a slot the previous adapter left is
    cleared first: this one may train other modules)."""
    placed, _ = place_adapter(model, adapter, max_rank)
    for module in model.modules():
        if isinstance(module, StackedLora):
            module.clear(index)
    for site, a, b in placed:
        lora = model.lora_slots(site.layer)[site.slot]
        assert isinstance(lora, LoraLinear)
        lora.write(index, site, a, b)
    for a, b in adapter.tables.values():  # place_adapter checked it is the token table
        table_lora = next(m for m in model.modules() if isinstance(m, LoraEmbedding))
        table_lora.write(index, a, b)
