"""How each encoder layout names its tensors, and reading them under the forward's slot names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poolserve.models.registry import EncoderLayout
from poolserve.models.weights import take


@dataclass(frozen=True)
class LayerNames:
    """Tensor names inside one layer (without `.weight` / `.bias`)."""

    prefix: str  # "{i}" stands for the layer index
    qkv: tuple[str, ...]  # one fused projection, or query, key, value
    o: str
    attn_norm: str  # post-LN: after attention; pre-LN: before it (absent on ModernBERT's first)
    up: tuple[str, ...]  # plain: (up,); gated: one fused (activated half first) or (gate, up)
    down: str
    mlp_norm: str


@dataclass(frozen=True)
class EmbeddingNames:
    """Tensor names outside the layers; optional ones may be absent from a checkpoint."""

    word: str = "embeddings.word_embeddings"
    position: str = "embeddings.position_embeddings"
    token_type: str = "embeddings.token_type_embeddings"  # optional
    projection: str = "embeddings.embed_proj"  # optional (DeBERTa's embedding_size != hidden)
    norm: str = "embeddings.LayerNorm"
    final_norm: str | None = None


_BERT_MLP = (("intermediate.dense",), "output.dense", "output.LayerNorm")
LAYOUTS: dict[EncoderLayout, tuple[EmbeddingNames, LayerNames]] = {
    EncoderLayout.BERT: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.self.{n}" for n in ("query", "key", "value")),
            "attention.output.dense",
            "attention.output.LayerNorm",
            *_BERT_MLP,
        ),
    ),
    EncoderLayout.DISTILBERT: (
        EmbeddingNames(),
        LayerNames(
            "transformer.layer.{i}.",
            tuple(f"attention.{n}_lin" for n in ("q", "k", "v")),
            "attention.out_lin",
            "sa_layer_norm",
            ("ffn.lin1",),
            "ffn.lin2",
            "output_layer_norm",
        ),
    ),
    EncoderLayout.MPNET: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.attn.{n}" for n in ("q", "k", "v")),
            "attention.attn.o",
            "attention.LayerNorm",
            *_BERT_MLP,
        ),
    ),
    EncoderLayout.DEBERTA: (
        EmbeddingNames(),
        LayerNames(
            "encoder.layer.{i}.",
            tuple(f"attention.self.{n}_proj" for n in ("query", "key", "value")),
            "attention.output.dense",
            "attention.output.LayerNorm",
            *_BERT_MLP,
        ),
    ),
    # Wi holds GeGLU's activated half first: act(input) * gate.
    EncoderLayout.MODERNBERT: (
        EmbeddingNames(
            word="embeddings.tok_embeddings", norm="embeddings.norm", final_norm="final_norm"
        ),
        LayerNames(
            "layers.{i}.", ("attn.Wqkv",), "attn.Wo", "attn_norm", ("mlp.Wi",), "mlp.Wo", "mlp_norm"
        ),
    ),
    # The Hub layout, which transformers also writes back: act(fc12) * fc11.
    EncoderLayout.NOMIC: (
        EmbeddingNames(norm="emb_ln"),
        LayerNames(
            "encoder.layers.{i}.",
            ("attn.Wqkv",),
            "attn.out_proj",
            "norm1",
            ("mlp.fc12", "mlp.fc11"),
            "mlp.fc2",
            "norm2",
        ),
    ),
}


def _fused(
    state: dict[str, torch.Tensor], names: tuple[str, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weights of the named projections stacked along outputs; biases too when saved."""
    weight = torch.cat([take(state, f"{name}.weight") for name in names])
    if f"{names[0]}.bias" not in state:
        return weight, None
    return weight, torch.cat([take(state, f"{name}.bias") for name in names])


def layer_tensors(
    state: dict[str, torch.Tensor], names: LayerNames, pre_norm: bool
) -> dict[str, torch.Tensor | None]:
    """One layer's tensors (its prefix removed) under the slot names EncoderLayer registers."""
    qkv, qkv_bias = _fused(state, names.qkv)
    up, up_bias = _fused(state, names.up)
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
