"""Rotary position embeddings computed from the config as transformers computes them."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from models.errors import ModelLoadError

# These types change inv_freq with the sequence length at run time; a packed batch has none.
_DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def _default_inv_freq(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Plain RoPE: base ** (-2i / head_dim), no post-scaling."""
    base = float(config.rope_parameters["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [head_dim/2]
    return 1.0 / (base**exponents), 1.0


class Rotary(torch.nn.Module):
    """Applies RoPE to packed queries and keys at explicit positions."""

    inv_freq: torch.Tensor

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type in _DYNAMIC_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(config, head_dim)
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise ModelLoadError(f"unknown rope type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [head_dim/2]
        self.scaling = float(scaling)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, 1, head_dim] each
        """cos and sin per token, computed in float32 then cast like the reference."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
        cos = emb.cos()
        sin = emb.sin()
        if self.scaling != 1.0:
            cos.mul_(self.scaling)
            sin.mul_(self.scaling)
        return cos.to(dtype), sin.to(dtype)


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    sin: torch.Tensor,  # [num_tokens, 1, head_dim]
) -> torch.Tensor:  # [num_tokens, heads, head_dim]
    """x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [num_tokens, heads, head_dim]
    return x * cos + rotated * sin
