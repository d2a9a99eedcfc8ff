"""One packed decoder forward for Llama, Mistral, Qwen2 and Qwen3."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from models.attention import AttentionBackend, AttentionMetadata
from models.kv_cache import PagedKVCache
from models.layers import activation, rms_norm, to_device
from models.packed import PackedModel
from models.registry import DecoderFamily
from models.rope import Rotary, apply_rotary
from models.weights import take


@dataclass(frozen=True)
class AttentionStep:
    """What every layer's attention needs in one forward."""

    backend: AttentionBackend
    meta: AttentionMetadata
    kv_cache: PagedKVCache | None


@dataclass(frozen=True)
class DecoderGeometry:
    """Sizes and constants one decoder layer needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float


def decoder_head_dim(config: PretrainedConfig) -> int:
    """head_dim from the config, or hidden_size / num_attention_heads."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit or config.hidden_size // config.num_attention_heads)


def layer_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Sliding window per layer: `layer_types` picks the layers when present, else all layers."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


class DecoderLayer(torch.nn.Module):
    """Pre-norm attention + gated MLP with fused qkv and gate/up weights."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up_weight: torch.Tensor
    down_weight: torch.Tensor
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        geometry: DecoderGeometry,
        act: Callable[[torch.Tensor], torch.Tensor],
        qk_norm: bool,
        placement: tuple[torch.device, torch.dtype],
        position: tuple[int, int | None],
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.act = act
        self.index, self.window = position
        names = ("q_proj", "k_proj", "v_proj")
        qkv = torch.cat([take(state, f"self_attn.{n}.weight") for n in names])
        biases = [state.get(f"self_attn.{n}.bias") for n in names]
        qkv_bias = (
            None
            if biases[0] is None
            else torch.cat([take(state, f"self_attn.{n}.bias") for n in names])
        )
        gate_up = torch.cat(
            [take(state, "mlp.gate_proj.weight"), take(state, "mlp.up_proj.weight")]
        )
        weights = {
            "qkv_weight": qkv,
            "qkv_bias": qkv_bias,
            "o_weight": take(state, "self_attn.o_proj.weight"),
            "o_bias": state.get("self_attn.o_proj.bias"),
            "q_norm": take(state, "self_attn.q_norm.weight") if qk_norm else None,
            "k_norm": take(state, "self_attn.k_norm.weight") if qk_norm else None,
            "gate_up_weight": gate_up,
            "down_weight": take(state, "mlp.down_proj.weight"),
            "input_norm": take(state, "input_layernorm.weight"),
            "post_attention_norm": take(state, "post_attention_layernorm.weight"),
        }
        for name, tensor in weights.items():
            self.register_buffer(name, to_device(tensor, *placement))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden] residual stream, updated in place
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [num_tokens, 1, head_dim]
        step: AttentionStep,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One layer over the packed stream."""
        g = self.geometry
        num_tokens = x.shape[0]
        h = rms_norm(x, self.input_norm, g.eps)  # [num_tokens, hidden]
        qkv = F.linear(h, self.qkv_weight, self.qkv_bias)  # [num_tokens, (H + 2 KV) * D]
        q_size, kv_size = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, g.num_heads, g.head_dim)  # [num_tokens, H, D]
        k = k.view(num_tokens, g.num_kv_heads, g.head_dim)  # [num_tokens, KV, D]
        v = v.view(num_tokens, g.num_kv_heads, g.head_dim)  # [num_tokens, KV, D]
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, g.eps)
            k = rms_norm(k, self.k_norm, g.eps)
        q = apply_rotary(q, *rope)
        k = apply_rotary(k, *rope)
        attended = step.backend.attend(
            q,
            k,
            v,
            layer=self.index,
            meta=step.meta,
            kv_cache=step.kv_cache,
            sliding_window=self.window,
            scale=g.scale,
        )  # [num_tokens, H, D]
        x.add_(F.linear(attended.reshape(num_tokens, q_size), self.o_weight, self.o_bias))
        h = rms_norm(x, self.post_attention_norm, g.eps)  # [num_tokens, hidden]
        gate, up = F.linear(h, self.gate_up_weight).chunk(2, dim=-1)  # [num_tokens, inter] each
        x.add_(F.linear(self.act(gate).mul_(up), self.down_weight))
        return x


class DecoderModel(PackedModel):
    """Llama-family decoder over packed tokens; returns final-normed hidden states."""

    embed_tokens: torch.Tensor
    norm: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        family: DecoderFamily,
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        head_dim = decoder_head_dim(config)
        geometry = DecoderGeometry(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim,
            eps=float(config.rms_norm_eps),
            scale=head_dim**-0.5,
        )
        act = activation(config.hidden_act)
        self.vocab_size = int(config.vocab_size)
        self.backend = backend
        windows = layer_windows(config)
        self.eps = geometry.eps
        self.rotary = Rotary(config, head_dim).to(placement[0])
        self.register_buffer(
            "embed_tokens", to_device(take(state, "embed_tokens.weight"), *placement)
        )
        self.register_buffer("norm", to_device(take(state, "norm.weight"), *placement))
        self.layers = torch.nn.ModuleList(
            DecoderLayer(
                {
                    k.removeprefix(f"layers.{i}."): v
                    for k, v in state.items()
                    if k.startswith(f"layers.{i}.")
                },
                geometry,
                act,
                family.qk_norm,
                placement,
                (i, windows[i]),
            )
            for i in range(config.num_hidden_layers)
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        attn: AttentionMetadata,
        kv_cache: PagedKVCache | None,
        out: torch.Tensor | None = None,  # [>= num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Embeds, runs every layer with chunk-aware attention, applies the final norm."""
        self.check_inputs(input_ids)
        x = F.embedding(input_ids, self.embed_tokens)  # [num_tokens, hidden]
        rope = self.rotary.cos_sin(positions, x.dtype)
        step = AttentionStep(self.backend, attn, kv_cache)
        for layer in self.layers:
            x = layer(x, rope, step)
        return self.deliver(rms_norm(x, self.norm, self.eps), out)
