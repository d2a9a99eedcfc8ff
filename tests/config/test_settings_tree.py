"""One settings tree: each setting defined once (ServerSettings), its scope on the field, and
the engine's tree built from it once (CoreConfig's nodes, the engine's own SchedulerConfig
among them) with the same defaults, every leaf reached by its setting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from poolserve.config.core import (
    DERIVED,
    NODE_OF,
    NODES,
    CoreConfig,
    LoadConfig,
    Placement,
    core_config,
    core_configs,
)
from poolserve.config.models_file import served_models
from poolserve.config.settings import (
    PER_MODEL,
    RUN_ONLY_SETTINGS,
    Scope,
    ServerSettings,
    default_of,
    scope_of,
    shapes_outputs,
)
from poolserve.types.limits import SchedulerConfig
from poolserve.types.params import LogitCalibration

FIELDS = ServerSettings.model_fields
# Leaves the settings leave to the engine: `SchedulerConfig.sized` computes them per model.
SIZED_BY_ENGINE = {"num_kv_blocks"}


def test_every_setting_carries_its_marks() -> None:
    for name in FIELDS:
        assert isinstance(scope_of(name), Scope)
        assert isinstance(shapes_outputs(name), bool)


def test_the_derived_sets_follow_the_marks() -> None:
    assert {n for n in FIELDS if scope_of(n) is Scope.MODEL} == PER_MODEL
    assert {n for n in FIELDS if not shapes_outputs(n)} == RUN_ONLY_SETTINGS
    # what a model's entry may set includes what it loads; the server's own never
    assert {"model", "dtype", "max_model_len", "pooler_config"} <= PER_MODEL
    assert not {"host", "port", "api_key", "api_server_count"} & PER_MODEL
    # a secret never reaches a job's manifest
    assert "api_key" in RUN_ONLY_SETTINGS


def test_each_leaf_belongs_to_one_node_and_is_a_setting_or_derived() -> None:
    leaves = [f.name for t in NODES.values() for f in dataclasses.fields(t)]
    assert len(leaves) == len(set(leaves)) == len(NODE_OF)  # a name reaches one node
    for name in leaves:
        assert name in FIELDS or name in DERIVED, name  # its setting's value, or derived


def test_every_leaf_has_its_settings_default() -> None:
    shared = [
        f
        for node in NODES.values()
        for f in dataclasses.fields(node)
        if f.name in FIELDS and f.name not in DERIVED | SIZED_BY_ENGINE
    ]
    assert len(shared) >= 15  # the walk walks the tree
    for f in shared:
        default = f.default_factory() if callable(f.default_factory) else f.default
        assert default == default_of(f.name), f.name


def test_the_defaults_tree_is_the_default_settings_tree() -> None:
    (config,) = core_configs(served_models(ServerSettings()))
    built = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, num_kv_blocks=4096)
    )
    assert built == CoreConfig()
    assert config.scheduler.num_kv_blocks is None  # sized by the engine for the model


def _non_default(name: str) -> Any:
    """A valid value for a setting that differs from its default."""
    values: dict[str, Any] = {
        "model": "some/model",
        "revision": "v2",
        "device": "cpu",
        "dtype": "bfloat16",
        "quantization": "int8",
        "allow_slower_precision": True,
        "max_model_len": 77,
        "max_num_batched_tokens": 999,
        "max_num_seqs": 7,
        "max_num_queued_requests": 11,
        "max_num_queued_tokens": 12345,
        "long_prefill_token_threshold": 64,
        "block_size": 8,
        "num_kv_blocks": 321,
        "async_scheduling": False,
        "enable_prefix_caching": False,
    }
    return values[name]


def test_every_setting_reaches_its_leaf() -> None:
    copied = [name for name in NODE_OF if name not in DERIVED]
    settings = ServerSettings(**{name: _non_default(name) for name in copied})
    (config,) = core_configs(served_models(settings))
    for name in copied:
        leaf = getattr(getattr(config, NODE_OF[name]), name)
        assert leaf == _non_default(name) != default_of(name), name


def test_the_derived_leaves_come_from_their_sources() -> None:
    settings = ServerSettings(
        model="some/model",
        pooler_config='{"pooling_type": "MEAN", "task": "embed", "logit_mean": 1.5}',
        hf_overrides='{"a": 1}',
        otlp_traces_endpoint="http://127.0.0.1:4318",
    )
    (served,) = served_models(settings).models
    config = core_config(dataclasses.replace(served, priority=3, gpu_memory_fraction=0.5))
    assert config.load.hf_overrides == {"a": 1}
    assert (config.pooler.embed_pooling, config.pooler.pooler_task) == (
        served.pooler.embed_pooling,
        served.pooler.task,
    )
    assert config.pooler.calibration == LogitCalibration(1.5, None)
    assert config.scheduler.record_timelines
    assert config.placement == Placement(priority=3, gpu_memory_fraction=0.5)


def test_of_places_each_value_in_its_node_and_refuses_unknown_names() -> None:
    config = CoreConfig.of(model="m", max_num_seqs=8, priority=2)
    assert config.load == LoadConfig(model="m")
    assert config.scheduler == SchedulerConfig(max_num_seqs=8)
    assert config.placement == Placement(priority=2)
    assert config.model == "m"
    with pytest.raises(TypeError, match="no field max_num_sequences"):
        CoreConfig.of(max_num_sequences=8)


@pytest.mark.parametrize("causal", [True, False])
def test_the_engine_sizes_what_the_settings_leave_to_it(causal: bool) -> None:
    settings = ServerSettings(
        max_num_batched_tokens=999, max_num_seqs=7, block_size=8, async_scheduling=False
    )
    (config,) = core_configs(served_models(settings))
    sized = config.scheduler.sized(512, causal)
    for f in dataclasses.fields(SchedulerConfig):
        if f.name not in {"num_kv_blocks", "enable_chunked_prefill", "enable_prefix_caching"}:
            assert getattr(sized, f.name) == getattr(config.scheduler, f.name), f.name
    assert sized.kv_blocks == 512 // 8 + -(-999 // 8)  # the longest prompt and one step
    assert (sized.enable_chunked_prefill, sized.enable_prefix_caching) == (causal, causal)


def test_sizing_refuses_what_the_model_cannot_run() -> None:
    with pytest.raises(ValueError, match="encoder prompts cannot be chunked"):
        SchedulerConfig(max_num_batched_tokens=256, num_kv_blocks=None).sized(512, causal=False)
    with pytest.raises(ValueError, match="it needs at least 32"):
        SchedulerConfig(num_kv_blocks=31, block_size=16).sized(512, causal=True)
    with pytest.raises(ValueError, match="not sized"):
        _ = SchedulerConfig(num_kv_blocks=None).kv_blocks


def test_a_model_entry_gets_the_server_settings_under_its_own() -> None:
    served = served_models(ServerSettings(max_num_seqs=9, port=8123))
    (model,) = served.models
    assert (model.settings.max_num_seqs, model.settings.port) == (9, 8123)
