"""What the encoder reads from a config: geometry, per-layer windows and ropes, remote fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

from poolserve.models.registry import ENCODER_FAMILIES, EncoderFamily, Positions, Relative
from poolserve.types.errors import ModelLoadError

# DistilBERT's LayerNorms are built with a fixed eps, whatever its config says.
_FIXED_EPS = 1e-12
_DEBERTA_SCORE_TERMS = ("c2p", "p2c")

# Hub NomicBERT configs are written for remote code: their field -> the native config's field.
_NOMIC_RENAMES = {
    "n_embd": "hidden_size",
    "n_head": "num_attention_heads",
    "n_layer": "num_hidden_layers",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "layer_norm_epsilon": "layer_norm_eps",
}
# Remote-code switches the native forward does not implement, with the values it accepts.
_NOMIC_ACCEPTED: dict[str, tuple[Any, ...]] = {
    "rotary_emb_fraction": (1.0,),
    "rotary_emb_interleaved": (False,),
    "rotary_scaling_factor": (None,),
    "prenorm": (False,),
    "parallel_block": (False,),
    "use_rms_norm": (False,),
    "causal": (False,),
    "moe_every_n_layers": (0, None),
}
# Remote-code gated activations -> the activation of their gate.
_NOMIC_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}


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


def deberta_score_terms(config: PretrainedConfig) -> tuple[str, ...]:
    """DeBERTa's position terms in the attention scores (c2p, p2c), as pos_att_type lists them."""
    listed = getattr(config, "pos_att_type", None) or ()
    return tuple(term for term in _DEBERTA_SCORE_TERMS if term in listed)


def encoder_geometry(config: PretrainedConfig, family: EncoderFamily) -> EncoderGeometry:
    """The layer geometry of an encoder config."""
    head_dim = encoder_head_dim(config)
    scale_factor = 1
    if family.relative is Relative.DISENTANGLED:
        # transformers scales by the terms pos_att_type names, even without relative_attention.
        scale_factor += len(deberta_score_terms(config))
    eps = _FIXED_EPS if family.eps_key is None else float(getattr(config, family.eps_key))
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


def adopt_remote_nomic_fields(config: PretrainedConfig) -> None:
    """Maps a Hub NomicBERT config's remote-code fields onto the native ones, in place.

    The spec is read from the same config afterwards, so the mapping has to land on it.
    Refuses switches the native forward lacks, naming each.
    """
    if not hasattr(config, "n_embd"):
        return
    unsupported = [
        f"{name}={getattr(config, name)!r}"
        for name, accepted in _NOMIC_ACCEPTED.items()
        if getattr(config, name, accepted[0]) not in accepted
    ]
    act = str(getattr(config, "activation_function", "swiglu"))
    if act not in _NOMIC_ACTIVATIONS:
        unsupported.append(f"activation_function={act!r}")
    if unsupported:
        raise ModelLoadError(
            "this NomicBERT config needs remote code for: " + ", ".join(unsupported)
        )
    for remote, native in _NOMIC_RENAMES.items():
        if hasattr(config, remote):
            setattr(config, native, getattr(config, remote))
    config.hidden_act = _NOMIC_ACTIVATIONS[act]
    config.head_dim = config.hidden_size // config.num_attention_heads
    base = float(getattr(config, "rotary_emb_base", 10_000.0))
    config.rope_parameters = {"rope_type": "default", "rope_theta": base}
