"""Pooling methods, heads, tasks and per-request chunk state."""

from poolserve.kinds import HeadKind
from poolserve.pooling.errors import (
    InvalidPoolingParamsError,
    PoolingConfigError,
    PoolingError,
    PoolingStateError,
    UnsupportedTaskError,
)
from poolserve.pooling.model_info import PoolingModelInfo
from poolserve.pooling.params import SUPPORTED_TASKS, PoolingParams, PoolingTask, PoolingType
from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import (
    ChunkInput,
    RequestPooler,
    build_pooler,
    get_supported_tasks,
    pool_step,
)
from poolserve.pooling.validation import validate_params

__all__ = [
    "SUPPORTED_TASKS",
    "ChunkInput",
    "CloneStats",
    "HeadKind",
    "InvalidPoolingParamsError",
    "PoolingConfigError",
    "PoolingError",
    "PoolingModelInfo",
    "PoolingParams",
    "PoolingStateError",
    "PoolingTask",
    "PoolingType",
    "RequestPooler",
    "UnsupportedTaskError",
    "build_pooler",
    "get_supported_tasks",
    "pool_step",
    "validate_params",
]
