"""Reading one encoder layer's tensors under the forward's slot names (names: models/families/)."""

from __future__ import annotations

import torch

from poolserve.models.families.records import LayerNames
from poolserve.models.weights import take


def _fused(
    state: dict[str, torch.Tensor], names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights of the named projections stacked along outputs; biases too when saved."""
    weight = torch.cat([take(state, f"{name}.weight") for name in names])
    if f"{names[0]}.bias" not in state:
        return weight, None
    return weight, torch.cat([take(state, f"{name}.bias") for name in names])


def _gate_first(fused: torch.Tensor) -> torch.Tensor:
    """A fused gated projection stored (up, gate) along outputs, reordered to (gate, up)."""
    up, gate = fused.chunk(2)
    return torch.cat([gate, up])


def layer_tensors(
    state: dict[str, torch.Tensor], names: LayerNames, pre_norm: bool
) -> dict[str, torch.Tensor | None]:
    """One layer's tensors (its prefix removed) under the slot names EncoderLayer registers."""
    qkv, qkv_bias = _fused(state, names.qkv)
    up, up_bias = _fused(state, names.up)
    if names.gate_second:
        up = _gate_first(up)
        up_bias = None if up_bias is None else _gate_first(up_bias)
    # ModernBERT's first layer has no attention norm; every post-LN layer has one.
    norm_name = f"{names.attn_norm}.weight"
    attn_norm = state.get(norm_name) if pre_norm else take(state, norm_name)
    return {
        "qkv_weight": qkv,
        "qkv_bias": qkv_bias,
        "o_weight": take(state, f"{names.o}.weight"),
        "o_bias": state.get(f"{names.o}.bias"),
        "attn_norm_weight": attn_norm,
        "attn_norm_bias": state.get(f"{names.attn_norm}.bias"),
        "up_weight": up,
        "up_bias": up_bias,
        "down_weight": take(state, f"{names.down}.weight"),
        "down_bias": state.get(f"{names.down}.bias"),
        "mlp_norm_weight": take(state, f"{names.mlp_norm}.weight"),
        "mlp_norm_bias": state.get(f"{names.mlp_norm}.bias"),
    }


def layer_state(
    state: dict[str, torch.Tensor], names: LayerNames, index: int
) -> dict[str, torch.Tensor]:
    """The tensors of layer `index`, its prefix removed."""
    prefix = names.prefix.format(i=index)
    return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
