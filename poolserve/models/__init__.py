"""Model loading and native forwards over packed tokens; attention backends."""

from poolserve.models.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from poolserve.models.kv_cache import PagedKVCache
from poolserve.models.loader import load_model
from poolserve.models.packed import PackedModel, validate_token_ids
from poolserve.models.spec import LoadedModel, ModelSpec
from poolserve.types.errors import (
    InvalidTokenIdError,
    ModelError,
    ModelLoadError,
    UnsafeCheckpointError,
    UnsupportedArchitectureError,
)
from poolserve.types.model import SentenceTransformersConfig
from poolserve.types.tasks import HeadKind

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "HeadKind",
    "InvalidTokenIdError",
    "LoadedModel",
    "ModelError",
    "ModelLoadError",
    "ModelSpec",
    "PackedModel",
    "PagedKVCache",
    "SentenceTransformersConfig",
    "UnsafeCheckpointError",
    "UnsupportedArchitectureError",
    "build_attention_metadata",
    "load_model",
    "validate_token_ids",
]
