"""What the encoder reads from a config: geometry, per-layer windows and ropes, max length."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from poolserve.models.families.deberta import deberta_score_terms
from poolserve.models.families.distilbert import LAYER_NORM_EPS
from poolserve.models.families.records import EncoderFamily, Positions, Relative
from poolserve.models.registry import ENCODER_FAMILIES
from poolserve.types.errors import ModelLoadError


@dataclass(frozen=True)
class EncoderGeometry:
    """Sizes and constants one encoder layer needs."""

    num_heads: int
    head_dim: int
    eps: float
    scale: float  # multiplies q.k before softmax (DeBERTa divides by sqrt(d * (1 + terms)))


def encoder_head_dim(config: PretrainedConfig) -> int:
    """head_dim (NomicBERT) or attention_head_size (DeBERTa) when set, else hidden / heads."""
    explicit = getattr(config, "head_dim", None) or getattr(config, "attention_head_size", None)
    return int(explicit or config.hidden_size // config.num_attention_heads)


def encoder_geometry(config: PretrainedConfig, family: EncoderFamily) -> EncoderGeometry:
    """The layer geometry of an encoder config."""
    head_dim = encoder_head_dim(config)
    scale_factor = 1
    if family.relative is Relative.DISENTANGLED:
        # transformers scales by the terms pos_att_type names, even without relative_attention.
        scale_factor += len(deberta_score_terms(config))
    eps = LAYER_NORM_EPS if family.eps_key is None else float(getattr(config, family.eps_key))
    return EncoderGeometry(
        num_heads=int(config.num_attention_heads),
        head_dim=head_dim,
        eps=eps,
        scale=float(head_dim * scale_factor) ** -0.5,
    )


def uses_position_table(config: PretrainedConfig, family: EncoderFamily) -> bool:
    """Whether learned position embeddings are added (DeBERTa-v3 turns them off)."""
    if family.positions is Positions.ROTARY:
        return False
    return family.position_flag is None or bool(getattr(config, family.position_flag, True))


def padding_idx(config: PretrainedConfig, family: EncoderFamily) -> int:
    """The padding id OFFSET positions count past."""
    if family.padding_idx is not None:
        return family.padding_idx
    if config.pad_token_id is None:
        raise ModelLoadError("offset positions need pad_token_id in the config")
    return int(config.pad_token_id)


def encoder_max_len(config: PretrainedConfig) -> int:
    """The longest prompt the position table holds; OFFSET positions start past padding_idx."""
    limit = int(config.max_position_embeddings)
    family = ENCODER_FAMILIES.get(config.model_type)
    if family is None or family.positions is not Positions.OFFSET:
        return limit
    return limit - padding_idx(config, family) - 1


def layer_rope_types(config: PretrainedConfig, family: EncoderFamily) -> tuple[str | None, ...]:
    """Per layer, the layer type whose rope applies (ModernBERT); None when one rope serves all."""
    layer_types = getattr(config, "layer_types", None)
    if family.positions is not Positions.ROTARY or layer_types is None:
        return (None,) * config.num_hidden_layers
    return tuple(str(kind) for kind in layer_types)


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Per layer, the backend's window (|q - k| < window) or None for global attention.

    ModernBERT's local layers keep |q - k| <= local_attention // 2 (its `sliding_window`).
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (None,) * config.num_hidden_layers
    window = int(getattr(config, "sliding_window", 0)) + 1
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
