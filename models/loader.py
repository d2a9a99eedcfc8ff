"""load_model(): config, weights, tokenizer, heads -> LoadedModel."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers.normalizers import Lowercase, Normalizer
from tokenizers.normalizers import Sequence as NormalizerSequence
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from models.attention import AttentionBackend, select_attention_backend
from models.decoder import DecoderModel
from models.decoder_config import decoder_head_dim, decoder_is_causal
from models.encoder import EncoderModel
from models.encoder_config import adopt_remote_nomic_fields, encoder_max_len
from models.errors import ModelLoadError, UnsafeCheckpointError, UnsupportedArchitectureError
from models.heads import build_heads, head_out_features
from models.packed import PackedModel
from models.registry import (
    ARCHITECTURES,
    DECODER_FAMILIES,
    ENCODER_FAMILIES,
    ArchitectureEntry,
    Backbone,
    supported_architectures,
)
from models.resolve import resolve_model_path
from models.sentence_transformers import read_sentence_transformers
from models.spec import HeadKind, LoadedModel, ModelHeads, ModelSpec
from models.weights import load_state_dict, strip_prefix

logger = logging.getLogger(__name__)

DEFAULT_DTYPES = {"cuda": torch.bfloat16}
_CLASSIFIER_KINDS = frozenset({HeadKind.SEQUENCE_CLASSIFIER, HeadKind.TOKEN_CLASSIFIER})


def load_model(
    model: str | None, *, device: torch.device, dtype: torch.dtype | None = None
) -> LoadedModel:
    """Loads a checkpoint (local dir, Hub id, or None = all-MiniLM-L6-v2) for packed forwards."""
    path = resolve_model_path(model)
    architecture = _check_architecture(_read_raw_config(path))
    entry = ARCHITECTURES[architecture]
    config = _load_config(path)
    dtype = dtype or DEFAULT_DTYPES.get(device.type, torch.float32)
    state = load_state_dict(path)
    backbone_state = strip_prefix(state, _backbone_prefix(entry, state))
    placement = (device, dtype)
    packed = _BACKBONES[entry.backbone](
        config, backbone_state, select_attention_backend(device), placement
    )
    heads = build_heads(entry, state, device, config)
    st_config = read_sentence_transformers(path, device)
    tokenizer = _load_tokenizer(path)
    if st_config is not None and st_config.do_lower_case:
        _lower_case_first(tokenizer)
    logger.info(
        "loaded %s (%s) from %s on %s as %s", architecture, config.model_type, path, device, dtype
    )
    return LoadedModel(
        path=path,
        spec=_spec(architecture, entry, config, heads, dtype),
        model=packed,
        heads=heads,
        tokenizer=tokenizer,
        sentence_transformers=st_config,
    )


def _read_raw_config(path: Path) -> dict[str, Any]:
    """config.json as plain JSON, read before transformers sees it."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"no config.json in {path}")
    try:
        raw = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelLoadError(f"malformed config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json is not a JSON object")
    return raw


def _check_architecture(raw: dict[str, Any]) -> str:
    """The supported architecture; remote-code-only checkpoints are refused."""
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ModelLoadError("config.json names no architecture")
    architecture = str(architectures[0])
    if architecture in ARCHITECTURES:
        if "auto_map" in raw:
            logger.warning(
                "ignoring auto_map of %s: the native implementation runs, never its remote code",
                architecture,
            )
        return architecture
    if "auto_map" in raw:
        raise UnsafeCheckpointError(
            f"{architecture} needs remote code (auto_map); trust_remote_code is refused"
        )
    raise UnsupportedArchitectureError(architecture, supported_architectures())


def _load_config(path: Path) -> PretrainedConfig:
    """The transformers config by model_type, never running remote code."""
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load config.json: {exc}") from exc
    return config


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer, never running remote code."""
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load tokenizer: {exc}") from exc


def _lower_case_first(tokenizer: PreTrainedTokenizerBase) -> None:
    """do_lower_case as sentence-transformers applies it: a Lowercase normalizer in front."""
    if not tokenizer.is_fast:
        raise ModelLoadError("do_lower_case needs a fast tokenizer (tokenizer.json)")
    backend = tokenizer.backend_tokenizer
    current = backend.normalizer
    parts: list[Normalizer] = [] if current is None else [current]
    if isinstance(current, NormalizerSequence):
        # a Sequence iterates over its parts at runtime; the stubs do not say so
        parts = list(cast(Iterable[Normalizer], current))
    # the same test sentence-transformers makes: a Lowercase, alone or in a Sequence
    if not any(isinstance(part, Lowercase) for part in parts):
        backend.normalizer = NormalizerSequence([Lowercase(), *parts])


def _backbone_prefix(entry: ArchitectureEntry, state: dict[str, torch.Tensor]) -> str:
    """The first candidate prefix under which the backbone's embeddings are stored."""
    markers = {
        Backbone.DECODER: ("embed_tokens.weight",),
        Backbone.ENCODER: ("embeddings.word_embeddings.weight", "embeddings.tok_embeddings.weight"),
    }
    for prefix in entry.backbone_prefixes:
        if any(f"{prefix}{marker}" in state for marker in markers[entry.backbone]):
            return prefix
    raise ModelLoadError(
        f"no backbone weights under any of the prefixes {list(entry.backbone_prefixes)}"
    )


def _decoder(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    backend: AttentionBackend,
    placement: tuple[torch.device, torch.dtype],
) -> PackedModel:
    """The packed decoder of a config whose model_type has a row in DECODER_FAMILIES."""
    family = DECODER_FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedArchitectureError(
            f"model_type {config.model_type}", supported_architectures()
        )
    return DecoderModel(config, state, family, backend, placement).eval()


def _encoder(
    config: PretrainedConfig,
    state: dict[str, torch.Tensor],
    backend: AttentionBackend,
    placement: tuple[torch.device, torch.dtype],
) -> PackedModel:
    """The packed encoder of a config whose model_type has a row in ENCODER_FAMILIES."""
    family = ENCODER_FAMILIES.get(config.model_type)
    if family is None:
        raise UnsupportedArchitectureError(
            f"model_type {config.model_type}", supported_architectures()
        )
    adopt_remote_nomic_fields(config)
    return EncoderModel(config, state, family, backend, placement).eval()


_BACKBONES: dict[Backbone, Callable[..., PackedModel]] = {
    Backbone.DECODER: _decoder,
    Backbone.ENCODER: _encoder,
}


def _spec(
    architecture: str,
    entry: ArchitectureEntry,
    config: PretrainedConfig,
    heads: ModelHeads,
    dtype: torch.dtype,
) -> ModelSpec:
    """The ModelSpec of a loaded checkpoint."""
    decoder = entry.backbone is Backbone.DECODER
    num_labels = head_out_features(heads)
    labels: tuple[str, ...] = ()
    if entry.head_kind in _CLASSIFIER_KINDS and num_labels is not None:
        id2label = getattr(config, "id2label", None) or {}
        labels = tuple(str(id2label.get(i, f"LABEL_{i}")) for i in range(num_labels))
    dims = getattr(config, "matryoshka_dimensions", None)
    matryoshka = tuple(int(d) for d in dims) if dims else None
    return ModelSpec(
        architecture=architecture,
        family=str(config.model_type),
        is_causal=decoder and decoder_is_causal(config),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        num_kv_heads=int(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        ),
        head_dim=decoder_head_dim(config)
        if decoder
        else config.hidden_size // config.num_attention_heads,
        max_model_len=int(config.max_position_embeddings) if decoder else encoder_max_len(config),
        dtype=dtype,
        head_kind=entry.head_kind,
        num_labels=num_labels,
        labels=labels,
        supports_matryoshka=bool(getattr(config, "is_matryoshka", False)) or matryoshka is not None,
        matryoshka_dimensions=matryoshka,
        classifier_pooling=None if decoder else getattr(config, "classifier_pooling", None),
    )
