"""Pooling methods, heads, tasks and per-request chunk state."""

from poolserve.pooling.stats import CloneStats
from poolserve.pooling.tasks import (
    ChunkInput,
    RequestPooler,
    build_pooler,
    get_supported_tasks,
    pool_step,
)
from poolserve.types.errors import (
    InvalidPoolingParamsError,
    PoolingConfigError,
    PoolingError,
    PoolingStateError,
    UnsupportedTaskError,
)
from poolserve.types.model_info import PoolingModelInfo
from poolserve.types.params import PoolingParams
from poolserve.types.tasks import SUPPORTED_TASKS, HeadKind, PoolingTask, PoolingType
from poolserve.types.validation import validate_params

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
