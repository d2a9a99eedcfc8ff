"""LoRA adapters applied per token: stacked A/B per adapted projection, picked by adapter index.

A step's tokens may belong to requests of different adapters. The base projection runs once over
every token; each adapter then adds `scale * (x @ A_i^T) @ B_i^T` to its own tokens only
(segmented by adapter index, an index_add per adapter present in the step). Tokens with no
adapter get the base projection alone.

Checkpoints written with torch's parametrize (jina-embeddings-v3's remote code) store a weight
as `X.parametrizations.weight.original` and its stacked LoRA as
`X.parametrizations.weight.0.lora_A` / `lora_B`; `unparametrize` renames them `X.weight`,
`X.lora_A`, `X.lora_B` so the family layouts read them by their plain names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F

from poolserve.models.layers import to_device
from poolserve.types.errors import ModelLoadError

_ORIGINAL = ".parametrizations.weight.original"
_LORA = ".parametrizations.weight.0."


def unparametrize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch parametrize names -> plain ones (`.weight`, `.lora_A`, `.lora_B`); else unchanged."""
    if not any(_ORIGINAL in key for key in state):
        return state
    return {key.replace(_ORIGINAL, ".weight").replace(_LORA, "."): v for key, v in state.items()}


@dataclass(frozen=True)
class AdapterSegments:
    """Which tokens of a step run which adapter: (adapter index, its rows) per adapter.

    The rows are a slice where the adapter's tokens are one run (the runner packs a step's
    chunks grouped by adapter: a view, no gather, no scatter), else their indices.
    """

    groups: tuple[tuple[int, slice | torch.Tensor], ...]

    @classmethod
    def from_chunks(
        cls, adapters: Sequence[int | None], lengths: Sequence[int], device: torch.device
    ) -> AdapterSegments | None:
        """The segments of a step whose chunks (in order, of `lengths` tokens) ran `adapters`
        (None: the chunk runs no adapter); None when no chunk runs one."""
        present = {a for a in adapters if a is not None}
        if not present:
            return None
        ends = np.cumsum(lengths)
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for adapter in sorted(present):
            runs = [
                (int(end - length), int(end))
                for a, length, end in zip(adapters, lengths, ends, strict=True)
                if a == adapter
            ]
            if all(stop == start for (_, stop), (start, _) in pairwise(runs)):
                groups.append((adapter, slice(runs[0][0], runs[-1][1])))
                continue
            index = np.concatenate([np.arange(start, stop) for start, stop in runs])
            groups.append((adapter, torch.from_numpy(index).to(device, non_blocking=True)))
        return cls(tuple(groups))


class StackedLora(torch.nn.Module):
    """Every adapter's A and B of one module, stacked on a first axis, and their scale."""

    a: torch.Tensor
    b: torch.Tensor
    # where the rank sits in A and in B (after the adapter axis), which must agree
    RANK_AXES: tuple[int, int]

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        in_a, in_b = self.RANK_AXES
        if (
            a.dim() != 3
            or b.dim() != 3
            or a.shape[0] != b.shape[0]
            or a.shape[in_a] != b.shape[in_b]
        ):
            raise ModelLoadError(f"LoRA shapes do not fit: A {tuple(a.shape)}, B {tuple(b.shape)}")
        self.scale = scale
        # the adapters with weights here; the others add nothing and are skipped
        self.held = set(range(a.shape[0]))
        self.register_buffer("a", to_device(a, *placement))
        self.register_buffer("b", to_device(b, *placement))

    def clear(self, index: int) -> None:
        """Adapter `index` adds nothing any more (its slot is free for another)."""
        self.a[index].zero_()
        self.b[index].zero_()
        self.held.discard(index)


@dataclass(frozen=True)
class LoraSite:
    """Where the LoRA of one module of a checkpoint lands: a part of a layer's projection slot.

    The forward fuses projections a checkpoint may store apart (query, key and value; gate and
    up): the slot's output rows are its parts' in order, and each part's adapter takes its own
    rank rows, so fused parts stay independent (a block-diagonal B).
    """

    layer: int
    slot: str  # the layer's projection slot: "qkv", "o", "up" or "gate_up", "down"
    part: int  # which of the slot's parts this module is
    parts: tuple[int, ...]  # each part's output rows, in the fused order
    in_features: int
    # GTE stores its fused gated projection (up, gate); the forward runs (gate, up)
    swap_halves: bool = False


class LoraLinear(StackedLora):
    """Stacked LoRA of one projection: A [num_adapters, rank, in], B [num_adapters, out, rank]."""

    RANK_AXES = (1, 2)

    # B's non-zero blocks (output rows, rank columns): one per fused part, the rest is zero
    blocks: tuple[tuple[slice, slice], ...]

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        scale: float,
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__(a, b, scale, placement)
        self.blocks = ((slice(0, b.shape[1]), slice(0, b.shape[2])),)

    @classmethod
    def empty(
        cls,
        capacity: int,
        rank: int,
        parts: tuple[int, ...],  # output rows of each fused part of the projection
        in_features: int,
        placement: tuple[torch.device, torch.dtype],
    ) -> LoraLinear:
        """Room for `capacity` adapters of up to `rank` per part, all zero (a zero adapter adds
        nothing); the scale is folded into each B as it is written."""
        a = torch.zeros(capacity, rank * len(parts), in_features)
        b = torch.zeros(capacity, sum(parts), rank * len(parts))
        lora = cls(a, b, 1.0, placement)
        lora.held.clear()
        starts = [sum(parts[:k]) for k in range(len(parts))]
        lora.blocks = tuple(
            (slice(start, start + size), slice(k * rank, (k + 1) * rank))
            for k, (start, size) in enumerate(zip(starts, parts, strict=True))
        )
        return lora

    def write(self, index: int, site: LoraSite, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter `index`'s A [r, in] and scaled B [out_part, r] as `site`'s part of the slot."""
        rank = a.shape[0]
        room = self.a.shape[1] // len(site.parts)  # rank rows per part
        first = site.part * room
        start = sum(site.parts[: site.part])
        if site.swap_halves:
            up, gate = b.chunk(2)
            b = torch.cat([gate, up])
        self.a[index, first : first + rank] = a.to(self.a.dtype)
        self.b[index, start : start + b.shape[0], first : first + rank] = b.to(self.b.dtype)
        self.held.add(index)

    def add_to(
        self,
        y: torch.Tensor,  # [num_tokens, out], the base projection of x; updated in place
        x: torch.Tensor,  # [num_tokens, in]
        segments: AdapterSegments,
    ) -> torch.Tensor:  # y
        """y + scale * (x @ A^T) @ B^T on each adapter's tokens."""
        for adapter, rows in segments.groups:
            if adapter not in self.held:
                continue
            a, b = self.a[adapter], self.b[adapter]  # [rank, in], [out, rank]
            if isinstance(rows, slice):
                # the adapter's tokens are one run: B's blocks add straight into y's view (a
                # fused projection's parts each by their own block, not the zeros between)
                h = F.linear(x[rows], a)  # [n, rank]
                out = y[rows]
                for outputs, ranks in self.blocks:
                    out[:, outputs].addmm_(h[:, ranks], b[outputs, ranks].t(), alpha=self.scale)
            else:
                delta = F.linear(F.linear(x.index_select(0, rows), a), b)  # [n, out]
                y.index_add_(0, rows, delta, alpha=self.scale)
        return y


class LoraEmbedding(StackedLora):
    """Stacked LoRA of an embedding table: A [num_adapters, rows, rank], B [.., rank, dim];
    the row of id t under adapter i moves by scale * A_i[t] @ B_i."""

    RANK_AXES = (2, 1)

    @classmethod
    def empty(
        cls,
        capacity: int,
        rank: int,
        shape: tuple[int, int],
        placement: tuple[torch.device, torch.dtype],
    ) -> LoraEmbedding:
        """Room for `capacity` adapters of up to `rank` on a table of `shape` (rows, dim), all
        zero; the scale is folded into each B as it is written."""
        rows, dim = shape
        lora = cls(
            torch.zeros(capacity, rows, rank), torch.zeros(capacity, rank, dim), 1.0, placement
        )
        lora.held.clear()
        return lora

    def write(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter `index`'s A [rows, r] and scaled B [r, dim] (rank zero-padded)."""
        rank = a.shape[1]
        self.a[index].zero_()
        self.b[index].zero_()
        self.a[index, :, :rank] = a.to(self.a.dtype)
        self.b[index, :rank] = b.to(self.b.dtype)
        self.held.add(index)

    def add_to(
        self,
        y: torch.Tensor,  # [num_tokens, dim], the base rows; updated in place
        ids: torch.Tensor,  # [num_tokens] int64
        segments: AdapterSegments,
    ) -> torch.Tensor:  # y
        """y + scale * A_i[ids] @ B_i on each adapter's tokens."""
        for adapter, rows in segments.groups:
            if adapter not in self.held:
                continue
            a, b = self.a[adapter], self.b[adapter]  # [rows, rank], [rank, dim]
            if isinstance(rows, slice):
                y[rows].add_(F.embedding(ids[rows], a) @ b, alpha=self.scale)
            else:
                delta = F.embedding(ids.index_select(0, rows), a) @ b  # [n, dim]
                y.index_add_(0, rows, delta, alpha=self.scale)
        return y


def lora_scale(config: object, rank: int) -> float:
    """alpha / rank: the config's `lora_alpha` (1 when absent) over the adapters' rank."""
    alpha = float(getattr(config, "lora_alpha", None) or 1.0)
    return alpha / rank


def take_lora_linear(
    state: dict[str, torch.Tensor],
    name: str,
    config: object,
    placement: tuple[torch.device, torch.dtype],
) -> LoraLinear | None:
    """The stacked LoRA stored beside projection `name` (`name.lora_A`, `name.lora_B`), if any."""
    a, b = state.get(f"{name}.lora_A"), state.get(f"{name}.lora_B")
    if a is None or b is None:
        return None
    return LoraLinear(a, b, lora_scale(config, int(a.shape[1])), placement)


def take_lora_embedding(
    state: dict[str, torch.Tensor],
    name: str,
    config: object,
    placement: tuple[torch.device, torch.dtype],
) -> LoraEmbedding | None:
    """The stacked LoRA stored beside embedding table `name`, if any."""
    a, b = state.get(f"{name}.lora_A"), state.get(f"{name}.lora_B")
    if a is None or b is None:
        return None
    return LoraEmbedding(a, b, lora_scale(config, int(a.shape[2])), placement)


def adapter_names(config: object) -> tuple[str, ...]:
    """The names of a checkpoint's stacked adapters, in index order (`lora_adaptations`)."""
    names = getattr(config, "lora_adaptations", None) or ()
    return tuple(str(name) for name in names)
