"""The transformer pieces the dual encoders' towers share: sizes, pre-LN layers, dense attention
over equal-length (or masked) sequences, and SigLIP's attention-pooling head. Plain tensors read
from the checkpoint's state, placed before the towers are built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from poolserve.models.layers import activation


@dataclass(frozen=True)
class Geometry:
    """One tower's sizes."""

    hidden: int
    num_heads: int
    eps: float
    act: str

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads


def tower_geometry(config: Any) -> Geometry:
    """A tower's sizes from its config (text_config or vision_config)."""
    return Geometry(
        config.hidden_size, config.num_attention_heads, config.layer_norm_eps, config.hidden_act
    )


# (weight, bias) of one LayerNorm or Linear; plain tensors, placed before the towers are built
Affine = tuple[torch.Tensor, torch.Tensor | None]


def affine(state: dict[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias under `prefix`."""
    return state[f"{prefix}weight"], state[f"{prefix}bias"]


class TowerLayer(torch.nn.Module):
    """A pre-LN transformer layer: x + attn(ln1(x)), then x + fc2(act(fc1(ln2(x))))."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str, geometry: Geometry) -> None:
        super().__init__()
        self.geometry = geometry
        self.act = activation(geometry.act)
        self.ln1 = affine(state, f"{prefix}layer_norm1.")
        self.ln2 = affine(state, f"{prefix}layer_norm2.")
        parts = [affine(state, f"{prefix}self_attn.{p}_proj.") for p in "qkv"]
        self.qkv = (torch.cat([w for w, _ in parts]), torch.cat([b for _, b in parts]))
        self.o = affine(state, f"{prefix}self_attn.out_proj.")
        self.fc1 = affine(state, f"{prefix}mlp.fc1.")
        self.fc2 = affine(state, f"{prefix}mlp.fc2.")
        # the projections seen as the layer's buffers too (the same tensors): what the engine
        # counts to size a CPU step's threads (engine/cpu_threads.py)
        for name in ("qkv", "o", "fc1", "fc2"):
            self.register_buffer(f"{name}_matrix", getattr(self, name)[0], persistent=False)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:  # [..., hidden]
        """One layer; `attend(q, k, v)` is the tower's attention over [..., heads, head_dim]."""
        g = self.geometry
        h = F.layer_norm(x, (g.hidden,), *self.ln1, g.eps)
        q, k, v = F.linear(h, *self.qkv).chunk(3, dim=-1)
        shape = (*x.shape[:-1], g.num_heads, g.head_dim)
        attended = attend(q.reshape(shape), k.reshape(shape), v.reshape(shape))
        x = x + F.linear(attended.reshape(x.shape), *self.o)
        h = F.layer_norm(x, (g.hidden,), *self.ln2, g.eps)
        return x + F.linear(self.act(F.linear(h, *self.fc1)), *self.fc2)


# A tower's attention over [..., num_tokens, heads, head_dim] queries, keys and values.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor | None = None
) -> torch.Tensor:
    """Bidirectional attention of equal-length sequences [B, N, heads, head_dim]; `keys`: a
    boolean mask of the keys each attends to, broadcast to [B, heads, queries, N]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keys
    )
    return out.transpose(1, 2)


class MapHead(torch.nn.Module):
    """SigLIP's attention pooling: a learned probe attends over the tokens, then an MLP."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str, geometry: Geometry) -> None:
        super().__init__()
        self.geometry = geometry
        self.act = activation(geometry.act)
        self.probe = state[f"{prefix}probe"]  # [1, 1, hidden]
        weight = state[f"{prefix}attention.in_proj_weight"].chunk(3)
        bias = state[f"{prefix}attention.in_proj_bias"].chunk(3)
        self.q, self.k, self.v = ((w, b) for w, b in zip(weight, bias, strict=True))
        self.o = affine(state, f"{prefix}attention.out_proj.")
        self.norm = affine(state, f"{prefix}layernorm.")
        self.fc1 = affine(state, f"{prefix}mlp.fc1.")
        self.fc2 = affine(state, f"{prefix}mlp.fc2.")

    def forward(
        self, x: torch.Tensor, keys: torch.Tensor | None = None
    ) -> torch.Tensor:  # [B, N, hidden] -> [B, hidden]
        """The probe's attention output (over the `keys` mask's tokens), plus the MLP of its
        normalized self."""
        g, batch = self.geometry, x.shape[0]
        shape = (batch, -1, g.num_heads, g.head_dim)
        q = F.linear(self.probe.expand(batch, -1, -1), *self.q).reshape(shape)
        k = F.linear(x, *self.k).reshape(shape)
        v = F.linear(x, *self.v).reshape(shape)
        h = F.linear(dense_attention(q, k, v, keys).reshape(batch, 1, g.hidden), *self.o)
        normed = F.layer_norm(h, (g.hidden,), *self.norm, g.eps)
        return (h + F.linear(self.act(F.linear(normed, *self.fc1)), *self.fc2))[:, 0]
