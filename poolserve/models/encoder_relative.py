"""Relative-position terms of encoder attention scores: MPNet's buckets, DeBERTa's disentangled."""

from __future__ import annotations

import abc
import math
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from poolserve.models.attention import AttentionBias
from poolserve.models.families.deberta import deberta_score_terms
from poolserve.models.layers import to_device
from poolserve.models.weights import take

# transformers' MPNet buckets with its defaults, whatever relative_attention_num_buckets says.
_MPNET_BUCKETS = 32
_MPNET_MAX_DISTANCE = 128


class LayerBiases(Protocol):
    """The score bias source of one forward; caches what depends only on sequence lengths."""

    def for_layer(
        self,
        index: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    ) -> AttentionBias:
        """The bias of layer `index`, given its queries and keys."""
        ...


class RelativeScores(torch.nn.Module, abc.ABC):
    """The model-level half: weights loaded once, a fresh LayerBiases per forward."""

    @abc.abstractmethod
    def begin(self) -> LayerBiases:
        """A bias source for one forward."""


def mpnet_buckets(length: int, device: torch.device) -> torch.Tensor:  # [length, length] int64
    """MPNet's (T5-style) bucket of key j for query i: signed, exact up to 8, log to 128."""
    positions = torch.arange(length, device=device)
    distance = positions[:, None] - positions[None, :]  # [q, k] query minus key
    half = _MPNET_BUCKETS // 2
    exact = half // 2
    buckets = (distance < 0).long() * half
    distance = distance.abs()
    log_ratio = torch.log(distance.float() / exact) / math.log(_MPNET_MAX_DISTANCE / exact)
    large = (exact + (log_ratio * (half - exact)).long()).clamp(max=half - 1)
    return buckets + torch.where(distance < exact, distance, large)


class BucketScores(RelativeScores):
    """MPNet: a learned bias per head and distance bucket, the same in every layer."""

    table: torch.Tensor

    def __init__(
        self, state: dict[str, torch.Tensor], placement: tuple[torch.device, torch.dtype]
    ) -> None:
        super().__init__()
        table = take(state, "encoder.relative_attention_bias.weight")  # [buckets, heads]
        self.register_buffer("table", to_device(table, *placement))

    def begin(self) -> LayerBiases:
        """Biases by sequence length, built once per forward."""
        return _SharedBias(self)

    def bias(self, length: int) -> torch.Tensor:  # [heads, length, length]
        """The bias of every query-key pair of a sequence."""
        buckets = mpnet_buckets(length, self.table.device)  # [length, length]
        return F.embedding(buckets, self.table).permute(2, 0, 1).contiguous()


class _SharedBias:
    """One bias per sequence length, whatever the layer."""

    def __init__(self, scores: BucketScores) -> None:
        self._scores = scores
        self._by_length: dict[int, torch.Tensor] = {}

    def for_layer(self, index: int, query: torch.Tensor, key: torch.Tensor) -> AttentionBias:
        """The same bias for every layer."""
        return self._bias

    def _bias(self, start: int, stop: int) -> torch.Tensor:  # [heads, n, n]
        """The bias of the sequence at start:stop, built on its length's first use."""
        if stop - start not in self._by_length:
            self._by_length[stop - start] = self._scores.bias(stop - start)
        return self._by_length[stop - start]


def deberta_buckets(
    length: int, bucket_size: int, max_position: int, device: torch.device
) -> torch.Tensor:  # [length, length] int64
    """DeBERTa's relative position of query i to key j (i - j), log-bucketed past bucket_size/2."""
    positions = torch.arange(length, device=device)
    relative = positions[:, None] - positions[None, :]  # [q, k]
    if bucket_size <= 0 or max_position <= 0:
        return relative
    # The same operations as transformers, so ceil() lands every distance in the same bucket.
    mid = bucket_size // 2
    sign = torch.sign(relative)
    inside = (relative < mid) & (relative > -mid)
    abs_pos = torch.where(inside, torch.tensor(mid - 1).type_as(relative), relative.abs())
    scale = torch.log(torch.tensor((max_position - 1) / mid))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / scale * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign).long()


def _deberta_span(config: PretrainedConfig) -> tuple[int, int, int]:
    """(attention span, position buckets, max relative positions) as DeBERTa resolves them."""
    max_relative = int(getattr(config, "max_relative_positions", -1))
    if max_relative < 1:
        max_relative = int(config.max_position_embeddings)
    buckets = int(getattr(config, "position_buckets", -1))
    return (buckets if buckets > 0 else max_relative), buckets, max_relative


class DisentangledScores(RelativeScores):
    """DeBERTa-v2: content-to-position (c2p) and position-to-content (p2c) score terms.

    The relative embeddings and their per-layer projections are constants of the checkpoint,
    so the position keys and queries of every layer are computed once here, pre-scaled.
    """

    pos_keys: torch.Tensor | None
    pos_queries: torch.Tensor | None

    def __init__(
        self,
        config: PretrainedConfig,
        state: dict[str, torch.Tensor],
        shape: tuple[int, int, int],  # (num_layers, num_heads, head_dim)
        scale: float,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        self.span, self.buckets, self.max_relative = _deberta_span(config)
        relative = self._relative_embeddings(config, state)  # [2 * span, hidden]
        terms = deberta_score_terms(config)
        shared = bool(getattr(config, "share_att_key", False))
        # share_att_key (v3) projects positions with the content key / query projections
        sources = {
            "pos_keys": ("c2p", "key_proj" if shared else "pos_key_proj"),
            "pos_queries": ("p2c", "query_proj" if shared else "pos_query_proj"),
        }
        for slot, (term, name) in sources.items():
            tensor = None
            if term in terms:
                layers = [
                    self._project(state, f"encoder.layer.{i}.attention.self.{name}.", relative)
                    for i in range(shape[0])
                ]
                view = (shape[0], 2 * self.span, shape[1], shape[2])
                tensor = torch.stack(layers).view(view) * scale  # [L, 2 span, H, D]
            self.register_buffer(slot, to_device(tensor, *placement))

    def _relative_embeddings(
        self, config: PretrainedConfig, state: dict[str, torch.Tensor]
    ) -> torch.Tensor:  # [2 * span, hidden] float32
        """rel_embeddings, layer-normed when norm_rel_ebd says so, cut to the attention span."""
        relative = take(state, "encoder.rel_embeddings.weight").float()
        norms = [part.strip() for part in str(getattr(config, "norm_rel_ebd", "none")).split("|")]
        if "layer_norm" in norms:
            weight, bias = (
                take(state, "encoder.LayerNorm.weight"),
                state.get("encoder.LayerNorm.bias"),
            )
            relative = F.layer_norm(
                relative,
                (relative.shape[-1],),
                weight.float(),
                None if bias is None else bias.float(),
                float(config.layer_norm_eps),
            )
        return relative[: 2 * self.span]

    @staticmethod
    def _project(
        state: dict[str, torch.Tensor], prefix: str, relative: torch.Tensor
    ) -> torch.Tensor:  # [2 * span, num_heads * head_dim]
        """One layer's projection of the relative embeddings, in float32."""
        bias = state.get(f"{prefix}bias")
        weight = take(state, f"{prefix}weight").float()
        return F.linear(relative, weight, None if bias is None else bias.float())

    def begin(self) -> LayerBiases:
        """Per-forward source; the bucket indices of each length are built once."""
        return _DisentangledBias(self)

    def indices(self, length: int, device: torch.device) -> torch.Tensor:  # [2, n, n] int64
        """c2p gather index [q, k] and p2c gather index [k, q] into the 2 * span positions."""
        relative = deberta_buckets(length, self.buckets, self.max_relative, device)  # [n, n]
        c2p = torch.clamp(relative + self.span, 0, 2 * self.span - 1)
        p2c = torch.clamp(-relative + self.span, 0, 2 * self.span - 1)
        return torch.stack([c2p, p2c])


class _DisentangledBias:
    """One forward's DeBERTa score terms, computed per layer from its queries and keys."""

    def __init__(self, scores: DisentangledScores) -> None:
        self._scores = scores
        self._indices: dict[int, torch.Tensor] = {}  # by sequence length, shared by layers

    def for_layer(self, index: int, query: torch.Tensor, key: torch.Tensor) -> AttentionBias:
        """c2p + p2c of layer `index` for one sequence's slice of the stream."""
        pos_keys, pos_queries = self._scores.pos_keys, self._scores.pos_queries

        def bias(start: int, stop: int) -> torch.Tensor:  # [heads, n, n]
            n, heads = stop - start, query.shape[1]
            if n not in self._indices:
                self._indices[n] = self._scores.indices(n, query.device)
            c2p_index, p2c_index = self._indices[n][:, None].expand(2, heads, n, n)  # [H, n, n]
            total = torch.zeros(heads, n, n, dtype=query.dtype, device=query.device)
            if pos_keys is not None:
                # query i against the position key of its distance to key j
                c2p = torch.einsum("qhd,rhd->hqr", query[start:stop], pos_keys[index])
                total += c2p.gather(-1, c2p_index)  # [H, q, 2 span] -> [H, q, k]
            if pos_queries is not None:
                # key j against the position query of its distance to query i, then [k, q] -> [q, k]
                p2c = torch.einsum("khd,rhd->hkr", key[start:stop], pos_queries[index])
                total += p2c.gather(-1, p2c_index).transpose(-1, -2)
            return total

        return bias
