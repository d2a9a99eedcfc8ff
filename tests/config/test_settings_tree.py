"""One settings tree: each setting defined once (ServerSettings), its scope on the field, and
every record built from it (CoreConfig, the engine's SchedulerConfig) with the same defaults."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from poolserve.config.core import NOT_COPIED, CoreConfig, core_config
from poolserve.config.models_file import served_models
from poolserve.config.pooler import PoolerDefaults
from poolserve.config.settings import (
    PER_MODEL,
    RUN_ONLY_SETTINGS,
    Scope,
    ServerSettings,
    default_of,
    scope_of,
    shapes_outputs,
)
from poolserve.engine.host import scheduler_config
from poolserve.types.limits import SchedulerConfig

FIELDS = ServerSettings.model_fields
# SchedulerConfig fields the engine computes from the model (not a setting's value as is)
COMPUTED_BY_ENGINE = {"num_kv_blocks", "enable_chunked_prefill"}


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


@pytest.mark.parametrize("record", [CoreConfig, SchedulerConfig])
def test_records_have_the_settings_defaults(record: type) -> None:
    shared = [
        f
        for f in dataclasses.fields(record)
        if f.name in FIELDS
        and f.name not in NOT_COPIED | COMPUTED_BY_ENGINE
        and f.default is not dataclasses.MISSING  # required: the model to load
    ]
    assert shared  # the walk walks something
    for f in shared:
        assert f.default == default_of(f.name), f.name


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


def test_core_config_copies_every_same_named_setting() -> None:
    copied = [f.name for f in dataclasses.fields(CoreConfig) if f.name not in NOT_COPIED]
    settings = ServerSettings(**{name: _non_default(name) for name in copied})
    config = core_config(settings, PoolerDefaults())
    for name in copied:
        assert getattr(config, name) == _non_default(name) != default_of(name), name


def test_the_engine_takes_every_budget_from_the_core_config() -> None:
    config = core_config(
        ServerSettings(
            max_num_batched_tokens=999,
            max_num_seqs=7,
            max_num_queued_requests=11,
            max_num_queued_tokens=12345,
            long_prefill_token_threshold=64,
            block_size=8,
            async_scheduling=False,
        ),
        PoolerDefaults(),
    )
    loaded: Any = SimpleNamespace(spec=SimpleNamespace(is_causal=True))
    limits = scheduler_config(config, loaded, max_model_len=512)
    for f in dataclasses.fields(SchedulerConfig):
        if f.name not in COMPUTED_BY_ENGINE:
            assert getattr(limits, f.name) == getattr(config, f.name), f.name
    assert limits.num_kv_blocks == 512 // 8 + -(-999 // 8)  # the longest prompt and one step


def test_a_model_entry_gets_the_server_settings_under_its_own() -> None:
    served = served_models(ServerSettings(max_num_seqs=9, port=8123))
    (model,) = served.models
    assert (model.settings.max_num_seqs, model.settings.port) == (9, 8123)
