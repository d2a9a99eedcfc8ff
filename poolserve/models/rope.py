"""Rotary position embeddings computed from the config as transformers computes them."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from poolserve.types.errors import ModelLoadError

# These types change inv_freq with the sequence length at run time; a packed batch has none.
_DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def rope_parameters(config: PretrainedConfig, layer_type: str | None) -> dict[str, Any]:
    """The rope parameters of the model, or of one layer type (Gemma3: local vs global)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is None:
        return dict(params)
    if not isinstance(params.get(layer_type), dict):
        raise ModelLoadError(f"config has no rope parameters for {layer_type!r} layers")
    return dict(params[layer_type])


def _default_inv_freq(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """Plain RoPE over the rotated part of each head: base ** (-2i / dim), no post-scaling."""
    base = float(params["rope_theta"])
    # Phi-3-style partial rotary: only the first dim channels of a head rotate.
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    return 1.0 / (base**exponents), 1.0


class Rotary(torch.nn.Module):
    """Applies RoPE to packed queries and keys at explicit positions."""

    inv_freq: torch.Tensor

    def __init__(
        self, config: PretrainedConfig, head_dim: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type in _DYNAMIC_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(params, head_dim)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            extra = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **extra)
        else:
            raise ModelLoadError(f"unknown rope type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [rotary_dim/2]
        self.scaling = float(scaling)
        # Qwen-VL's M-RoPE: the rotary channels split among three position rows (frame, row,
        # column of an image's tokens; all three equal for text), in sections or interleaved
        section = params.get("mrope_section")
        self.mrope_section = tuple(int(s) for s in section) if section else None
        self.mrope_interleaved = bool(params.get("mrope_interleaved", False))

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, 1, rotary_dim] each
        """cos and sin per token, computed in float32 then cast like the reference; positions
        [num_tokens], or M-RoPE's three rows [3, num_tokens]."""
        if positions.dim() == 2:
            freqs = self._mrope_freqs(positions)  # [num_tokens, rotary_dim/2]
        else:
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [num_tokens, 1, rotary_dim]
        cos = emb.cos()
        sin = emb.sin()
        if self.scaling != 1.0:
            cos.mul_(self.scaling)
            sin.mul_(self.scaling)
        return cos.to(dtype), sin.to(dtype)

    def _mrope_freqs(self, positions: torch.Tensor) -> torch.Tensor:  # [num_tokens, dim/2]
        """Each rotary channel's angle from its own position row: Qwen2-VL gives consecutive
        sections to frame, row and column in turn; Qwen3-VL interleaves them channel by channel
        (row and column within their sections' span, frame everywhere else)."""
        section = self.mrope_section
        if section is None or positions.shape[0] != 3:
            raise ValueError(f"positions {tuple(positions.shape)} for a model without M-RoPE")
        freqs = positions.float()[..., None] * self.inv_freq  # [3, num_tokens, rotary_dim/2]
        if not self.mrope_interleaved:
            parts = freqs.split(list(section), dim=-1)
            return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        mixed = freqs[0].clone()
        for row in (1, 2):
            span = slice(row, section[row] * 3, 3)
            mixed[..., span] = freqs[row, ..., span]
        return mixed


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, rotary_dim]
    sin: torch.Tensor,  # [num_tokens, 1, rotary_dim]
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """x * cos + rotate_half(x) * sin over the first rotary_dim channels; the rest pass."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)  # [num_tokens, heads, rotary_dim]
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    # rotate_half(x) * sin added half by half into x * cos: one new tensor and three passes,
    # where the reference's negation, cat, two products and sum write five
    out = x * cos  # [num_tokens, heads, head_dim]
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out
