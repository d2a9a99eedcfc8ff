"""What the decoder reads from a config: geometry, scales, windows, rope types, direction."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from poolserve.models.families.records import DecoderFamily
from poolserve.models.layers import softcap
from poolserve.models.registry import DECODER_FAMILIES


@dataclass(frozen=True)
class DecoderGeometry:
    """Sizes and constants one decoder layer needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # multiplies q.k before soft-capping and softmax
    softcap: float | None  # tanh soft-capping of attention logits
    residual_multiplier: float  # scales each block's output before the residual add


@dataclass(frozen=True)
class LogitsTransform:
    """What transformers' *ForCausalLM does to LM-head logits after the projection."""

    divisor: float  # Granite's logits_scaling
    softcap: float | None  # Gemma2/3's final_logit_softcapping

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Divides, then soft-caps, as the reference does."""
        if self.divisor != 1.0:
            logits = logits / self.divisor
        return softcap(logits, self.softcap)


def decoder_head_dim(config: PretrainedConfig) -> int:
    """head_dim from the config, or hidden_size / num_attention_heads."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit or config.hidden_size // config.num_attention_heads)


def _optional_float(config: PretrainedConfig, name: str) -> float | None:
    """A float config field that may be absent or null."""
    value = getattr(config, name, None)
    return None if value is None else float(value)


def _attention_scale(config: PretrainedConfig, family: DecoderFamily, head_dim: int) -> float:
    """Granite's attention_multiplier, Gemma2/3's query_pre_attn_scalar ** -0.5, else head_dim."""
    if family.multipliers:
        return float(config.attention_multiplier)
    if family.query_pre_attn_scalar:
        return float(config.query_pre_attn_scalar) ** -0.5
    return float(head_dim) ** -0.5


def decoder_geometry(config: PretrainedConfig, family: DecoderFamily) -> DecoderGeometry:
    """The layer geometry and per-family constants of a decoder config."""
    head_dim = decoder_head_dim(config)
    return DecoderGeometry(
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        eps=float(config.rms_norm_eps),
        scale=_attention_scale(config, family, head_dim),
        softcap=_optional_float(config, "attn_logit_softcapping") if family.attn_softcap else None,
        residual_multiplier=float(config.residual_multiplier) if family.multipliers else 1.0,
    )


def embed_scale(
    config: PretrainedConfig, family: DecoderFamily, dtype: torch.dtype
) -> float | None:
    """The factor on token embeddings: Gemma's sqrt(hidden), Granite's embedding_multiplier."""
    if family.embed_scale:
        # transformers rounds sqrt(hidden) to the weights' dtype first (55.4256 -> 55.5 in bf16).
        return float(torch.tensor(config.hidden_size**0.5).to(dtype))
    if family.multipliers:
        return float(config.embedding_multiplier)
    return None


def decoder_is_causal(config: PretrainedConfig) -> bool:
    """False for `is_causal: false` configs, Gemmas with use_bidirectional_attention and
    families that are always bidirectional (EuroBERT)."""
    if not getattr(config, "is_causal", True):
        return False
    family = DECODER_FAMILIES.get(config.model_type)
    if family is not None and family.bidirectional:
        return False
    flag = bool(getattr(config, "use_bidirectional_attention", False))
    return not (family is not None and family.bidirectional_flag and flag)


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Sliding window per layer (`layer_types` picks the layers, else all); None for full layers.

    The backends keep keys with q - k < window (causal) or |q - k| < window (bidirectional).
    """
    window = getattr(config, "sliding_window", None)
    if window is not None and not getattr(config, "is_causal", True):
        # transformers' `is_causal: false` sliding mask keeps |q - k| <= window, one more key.
        # Gemma3's use_bidirectional_attention has already made its window exclusive.
        window += 1
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def layer_rope_types(config: PretrainedConfig, family: DecoderFamily) -> tuple[str | None, ...]:
    """Per layer, the layer type whose rope parameters apply; None when one rope serves all."""
    if not family.rope_per_layer_type:
        return (None,) * config.num_hidden_layers
    return tuple(str(kind) for kind in config.layer_types)


def logits_transform(config: PretrainedConfig, family: DecoderFamily) -> LogitsTransform:
    """The post-projection transform of the family's *ForCausalLM logits."""
    return LogitsTransform(
        divisor=float(config.logits_scaling) if family.multipliers else 1.0,
        softcap=_optional_float(config, "final_logit_softcapping")
        if family.final_softcap
        else None,
    )
