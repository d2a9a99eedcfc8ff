"""`CoreConfig`: what the engine core needs of one served model's settings, built once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from poolserve.config.models_file import ServedModels
from poolserve.config.pooler import PoolerDefaults
from poolserve.config.settings import ServerSettings, default_of
from poolserve.types.lora import LoraServing
from poolserve.types.tasks import PoolingTask, PoolingType


@dataclass(frozen=True)
class CoreConfig:
    """Everything the engine core needs to load the model and build its engine."""

    model: str | None
    revision: str | None = default_of("revision")
    device: str = default_of("device")
    dtype: str = default_of("dtype")
    quantization: str | None = default_of("quantization")
    allow_slower_precision: bool = default_of("allow_slower_precision")
    hf_overrides: dict[str, Any] | None = None
    max_model_len: int | None = default_of("max_model_len")
    embed_pooling: PoolingType | None = None
    pooler_task: PoolingTask | None = None  # --pooler-config's task (vLLM's PoolerConfig.task)
    # vLLM's logit_mean/logit_sigma (--pooler-config): classifier logits calibrated in the core
    logit_mean: float | None = None
    logit_sigma: float | None = None
    max_num_batched_tokens: int = default_of("max_num_batched_tokens")
    max_num_seqs: int = default_of("max_num_seqs")
    max_num_queued_requests: int = default_of("max_num_queued_requests")
    max_num_queued_tokens: int = default_of("max_num_queued_tokens")
    long_prefill_token_threshold: int | None = default_of("long_prefill_token_threshold")
    block_size: int = default_of("block_size")
    num_kv_blocks: int | None = default_of("num_kv_blocks")  # None: the longest prompt + a step
    async_scheduling: bool = default_of("async_scheduling")
    enable_prefix_caching: bool = default_of("enable_prefix_caching")
    record_timelines: bool = False
    # several models on one device: among engines waiting for it the lower priority steps first
    priority: int = 0
    # CUDA: the most of the device's memory this model may hold (weights + KV pool); None: no cap
    gpu_memory_fraction: float | None = None
    lora: LoraServing | None = None  # --lora-modules, --max-loras, --max-lora-rank


# CoreConfig fields that a setting of the same name does not give as is.
NOT_COPIED = frozenset(
    {"hf_overrides", "embed_pooling", "pooler_task", "logit_mean", "logit_sigma"}
    | {"record_timelines"}
    | {"priority", "gpu_memory_fraction"}  # a --models-config entry's own keys
    | {"lora"}  # the settings' lora property: --lora-modules parsed, with its limits
)


def core_config(settings: ServerSettings, defaults: PoolerDefaults) -> CoreConfig:
    """What the engine core needs from one model's settings: each field of the same name as
    is, the rest derived from them."""
    same = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(CoreConfig)
        if f.name not in NOT_COPIED
    }
    return CoreConfig(
        **same,
        hf_overrides=settings.hf_overrides_dict,  # with --matryoshka-dimensions folded in
        embed_pooling=defaults.embed_pooling,
        pooler_task=defaults.task,
        # model-level, as in vLLM: the core applies them, whichever front end asks
        logit_mean=defaults.calibration.mean,
        logit_sigma=defaults.calibration.sigma,
        record_timelines=settings.otlp_traces_endpoint is not None,
        lora=settings.lora,
    )


def core_configs(served: ServedModels) -> tuple[CoreConfig, ...]:
    """One core config per model, in order: its settings', and how it shares the device."""
    configs = []
    for model in served.models:
        config = core_config(model.settings, model.pooler)
        configs.append(
            dataclasses.replace(
                config, priority=model.priority, gpu_memory_fraction=model.gpu_memory_fraction
            )
        )
    return tuple(configs)
