"""Packed BERT-family encoder forward (absolute positions, post-LN, bidirectional)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from models.attention import AttentionBackend, AttentionMetadata
from models.errors import ModelLoadError
from models.kv_cache import PagedKVCache
from models.layers import activation, to_device
from models.packed import PackedModel
from models.weights import take


@dataclass(frozen=True)
class EncoderGeometry:
    """Sizes and constants one encoder layer needs."""

    num_heads: int
    head_dim: int
    eps: float
    scale: float


class EncoderLayer(torch.nn.Module):
    """Self-attention + MLP, each followed by residual add and LayerNorm."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    o_weight: torch.Tensor
    o_bias: torch.Tensor
    attn_norm_weight: torch.Tensor
    attn_norm_bias: torch.Tensor
    up_weight: torch.Tensor
    up_bias: torch.Tensor
    down_weight: torch.Tensor
    down_bias: torch.Tensor
    out_norm_weight: torch.Tensor
    out_norm_bias: torch.Tensor

    def __init__(
        self,
        state: dict[str, torch.Tensor],
        geometry: EncoderGeometry,
        act: Callable[[torch.Tensor], torch.Tensor],
        placement: tuple[torch.device, torch.dtype],
        index: int,
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.act = act
        self.index = index
        names = ("query", "key", "value")
        weights = {
            "qkv_weight": torch.cat([take(state, f"attention.self.{n}.weight") for n in names]),
            "qkv_bias": torch.cat([take(state, f"attention.self.{n}.bias") for n in names]),
            "o_weight": take(state, "attention.output.dense.weight"),
            "o_bias": take(state, "attention.output.dense.bias"),
            "attn_norm_weight": take(state, "attention.output.LayerNorm.weight"),
            "attn_norm_bias": take(state, "attention.output.LayerNorm.bias"),
            "up_weight": take(state, "intermediate.dense.weight"),
            "up_bias": take(state, "intermediate.dense.bias"),
            "down_weight": take(state, "output.dense.weight"),
            "down_bias": take(state, "output.dense.bias"),
            "out_norm_weight": take(state, "output.LayerNorm.weight"),
            "out_norm_bias": take(state, "output.LayerNorm.bias"),
        }
        for name, tensor in weights.items():
            self.register_buffer(name, to_device(tensor, *placement))

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """One post-LN layer over the packed stream."""
        g = self.geometry
        num_tokens, hidden = x.shape
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [num_tokens, 3 * hidden]
        q, k, v = (t.view(num_tokens, g.num_heads, g.head_dim) for t in qkv.chunk(3, dim=-1))
        attended = backend.attend(
            q, k, v, layer=self.index, meta=meta, kv_cache=None, sliding_window=None, scale=g.scale
        )  # [num_tokens, H, D]
        h = F.linear(attended.reshape(num_tokens, hidden), self.o_weight, self.o_bias)
        x = F.layer_norm(h.add_(x), (hidden,), self.attn_norm_weight, self.attn_norm_bias, g.eps)
        h = self.act(F.linear(x, self.up_weight, self.up_bias))  # [num_tokens, intermediate]
        h = F.linear(h, self.down_weight, self.down_bias)  # [num_tokens, hidden]
        return F.layer_norm(h.add_(x), (hidden,), self.out_norm_weight, self.out_norm_bias, g.eps)


class EncoderModel(PackedModel):
    """BERT-family encoder over packed tokens; returns the last layer's output."""

    word_embeddings: torch.Tensor
    position_embeddings: torch.Tensor
    token_type_row: torch.Tensor
    embed_norm_weight: torch.Tensor
    embed_norm_bias: torch.Tensor

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        backend: AttentionBackend,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError("only absolute position embeddings are supported for encoders")
        head_dim = config.hidden_size // config.num_attention_heads
        geometry = EncoderGeometry(
            num_heads=config.num_attention_heads,
            head_dim=head_dim,
            eps=float(config.layer_norm_eps),
            scale=head_dim**-0.5,
        )
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.eps = geometry.eps
        self.backend = backend
        embeddings = {
            "word_embeddings": take(state, "embeddings.word_embeddings.weight"),
            "position_embeddings": take(state, "embeddings.position_embeddings.weight"),
            # token_type_ids are all 0: only the first type row is ever added.
            "token_type_row": take(state, "embeddings.token_type_embeddings.weight")[0],
            "embed_norm_weight": take(state, "embeddings.LayerNorm.weight"),
            "embed_norm_bias": take(state, "embeddings.LayerNorm.bias"),
        }
        for name, tensor in embeddings.items():
            self.register_buffer(name, to_device(tensor, *placement))
        act = activation(config.hidden_act)
        self.layers = torch.nn.ModuleList(
            EncoderLayer(
                {
                    k.removeprefix(f"encoder.layer.{i}."): v
                    for k, v in state.items()
                    if k.startswith(f"encoder.layer.{i}.")
                },
                geometry,
                act,
                placement,
                i,
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
        """Embeds with absolute positions and runs every layer bidirectionally."""
        self.check_inputs(input_ids)
        if attn.causal or attn.has_context:
            raise ValueError("encoder attention is bidirectional and never chunked")
        x = F.embedding(input_ids, self.word_embeddings)  # [num_tokens, hidden]
        x += F.embedding(positions, self.position_embeddings)
        x += self.token_type_row
        x = F.layer_norm(
            x, (self.hidden_size,), self.embed_norm_weight, self.embed_norm_bias, self.eps
        )
        for layer in self.layers:
            x = layer(x, self.backend, attn)
        return self.deliver(x, out)
