"""The engine's settings tree: what the engine core needs of one served model, built once from
its settings and passed down whole (each node to the part that owns it, nothing copied again).

    CoreConfig
    ├── load        LoadConfig: what is loaded and how it computes (the loader's)
    ├── scheduler   SchedulerConfig: budgets, admission, KV pool, switches (the engine's own
    │               record, types/limits.py; the engine sizes what is left to it: `sized`)
    ├── pooler      PoolerConfig: --pooler-config's model-level keys, applied in the core
    └── placement   Placement: how the model shares the device with the others

A setting reaches the node that has a field of its name (each name belongs to one node), so
a flag or a models-file key is defined once, in `ServerSettings`, and read once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from poolserve.config.models_file import ServedModel, ServedModels
from poolserve.config.settings import ServerSettings, default_of
from poolserve.types.limits import SchedulerConfig
from poolserve.types.lora import LoraServing
from poolserve.types.params import LogitCalibration
from poolserve.types.tasks import PoolingTask, PoolingType


@dataclass(frozen=True)
class LoadConfig:
    """What the loader reads and how the model computes."""

    model: str | None = None  # None: the embedded all-MiniLM-L6-v2
    revision: str | None = default_of("revision")
    device: str = default_of("device")
    dtype: str = default_of("dtype")
    quantization: str | None = default_of("quantization")
    allow_slower_precision: bool = default_of("allow_slower_precision")
    hf_overrides: dict[str, Any] | None = None  # with --matryoshka-dimensions folded in
    max_model_len: int | None = default_of("max_model_len")  # None: the model's own
    lora: LoraServing | None = None  # --lora-modules, --max-loras, --max-lora-rank


@dataclass(frozen=True)
class PoolerConfig:
    """--pooler-config's model-level keys: the same for every request, so the core applies
    them, whichever front end asks (as vLLM does)."""

    embed_pooling: PoolingType | None = None
    pooler_task: PoolingTask | None = None  # vLLM's PoolerConfig.task, checked at load
    calibration: LogitCalibration = field(default_factory=LogitCalibration)  # logit_mean/sigma


@dataclass(frozen=True)
class Placement:
    """How one model shares the device with the others (a --models-config entry's keys)."""

    # several models on one device: among engines waiting for it the lower priority steps first
    priority: int = 0
    # CUDA: the most of the device's memory this model may hold (weights + KV pool); None: no cap
    gpu_memory_fraction: float | None = None


@dataclass(frozen=True)
class CoreConfig:
    """One served model's engine settings, as a tree (the module's docstring draws it)."""

    load: LoadConfig = field(default_factory=LoadConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    placement: Placement = field(default_factory=Placement)

    @property
    def model(self) -> str | None:
        """The model loaded, as the operator named it (what errors and logs name)."""
        return self.load.model

    @classmethod
    def of(cls, **values: Any) -> CoreConfig:
        """The tree holding `values`, each given by its field's name in whichever node has it
        (the rest at their defaults): `CoreConfig.of(model=..., max_num_seqs=8)`."""
        unknown = set(values) - set(NODE_OF)
        if unknown:
            raise TypeError(f"CoreConfig has no field {', '.join(sorted(unknown))}")
        nodes = {
            node: record(**{name: v for name, v in values.items() if NODE_OF[name] == node})
            for node, record in NODES.items()
        }
        return cls(**nodes)

    def flat(self) -> dict[str, Any]:
        """Every leaf by its name (the inverse of `of`; what crosses to a spawned process)."""
        return {
            f.name: getattr(getattr(self, node), f.name)
            for node in NODES
            for f in dataclasses.fields(NODES[node])
        }


# The nodes, by their field in CoreConfig; NODE_OF: each leaf's node (leaf names are unique).
NODES: dict[str, type] = {
    "load": LoadConfig,
    "scheduler": SchedulerConfig,
    "pooler": PoolerConfig,
    "placement": Placement,
}
NODE_OF: dict[str, str] = {f.name: node for node, t in NODES.items() for f in dataclasses.fields(t)}

# Leaves no setting of the same name gives as is: each is derived in `core_config`, or (the
# scheduler's) computed by the engine from the model it loads.
DERIVED = frozenset(
    {"hf_overrides", "lora"}  # the settings' parsed forms of their flags
    | {"embed_pooling", "pooler_task", "calibration"}  # from --pooler-config
    | {"record_timelines"}  # on when traces are exported
    | {"priority", "gpu_memory_fraction"}  # a --models-config entry's own keys
    | {"enable_chunked_prefill"}  # the engine's: causal models only
)


def core_config(served: ServedModel) -> CoreConfig:
    """One model's tree: each leaf from the setting of its name, the derived ones from theirs."""
    settings: ServerSettings = served.settings
    same = {name: getattr(settings, name) for name in NODE_OF if name not in DERIVED}
    pooler = served.pooler
    return CoreConfig.of(
        **same,
        hf_overrides=settings.hf_overrides_dict,
        lora=settings.lora,
        embed_pooling=pooler.embed_pooling,
        pooler_task=pooler.task,
        calibration=pooler.calibration,
        record_timelines=settings.otlp_traces_endpoint is not None,
        priority=served.priority,
        gpu_memory_fraction=served.gpu_memory_fraction,
    )


def core_configs(served: ServedModels) -> tuple[CoreConfig, ...]:
    """One tree per model, in order."""
    return tuple(core_config(model) for model in served.models)
