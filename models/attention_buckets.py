"""Length buckets of one step: sequences of similar length attended in one padded SDPA call."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# A sequence joins a bucket whose longest member has L tokens when L^2 - n^2 <= this many padded
# scores per head: below it the padding costs less than the SDPA call it saves (about 40 us
# with 2 threads at MiniLM's shape, against about 13 ns per padded score). So short sequences
# share a bucket freely, and long ones only with members of nearly the same length.
MAX_PADDED_SCORES = 64 * 64
MAX_BUCKET_LEN = 1 << 20


@dataclass(frozen=True)
class SequenceBucket:
    """Sequences attended together, each padded on the right to the longest member."""

    seq_ids: tuple[int, ...]  # sequence indices of the members, longest first
    padded_len: int  # L, the longest member's length
    gather_index: torch.Tensor  # [num_members * L] int64 stream index of each padded slot
    keep_index: torch.Tensor  # [num_bucket_tokens] int64 padded slot of each real token
    stream_index: torch.Tensor  # [num_bucket_tokens] int64 stream index of the same tokens
    key_mask: torch.Tensor | None  # [num_members, 1, 1, L] bool, True at real keys; None: no pad

    @property
    def num_seqs(self) -> int:
        """Members of the bucket."""
        return len(self.seq_ids)


@dataclass(frozen=True)
class BucketLayout:
    """How a step's sequences are attended: padded buckets, and sequences attended alone."""

    buckets: tuple[SequenceBucket, ...]
    single: tuple[int, ...]  # cached context, or no bucket mate: one SDPA call on its own views


def _groups(lens_q: np.ndarray, batchable: np.ndarray) -> list[list[int]]:
    """Greedy grouping, longest first, under the padded-score budget."""
    batchable = batchable & (lens_q <= MAX_BUCKET_LEN)
    order = sorted(np.flatnonzero(batchable).tolist(), key=lambda i: -int(lens_q[i]))
    groups: list[list[int]] = []
    for i in order:
        if groups and int(lens_q[groups[-1][0]]) ** 2 - int(lens_q[i]) ** 2 <= MAX_PADDED_SCORES:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _bucket(
    members: list[int], lens_q: np.ndarray, starts: np.ndarray, device: torch.device
) -> SequenceBucket:
    """Index tensors of one bucket; padding slots read the member's first token (masked out)."""
    lens = lens_q[members]  # [B]
    padded_len = int(lens[0])
    slot = np.arange(padded_len, dtype=np.int64)  # [L]
    real = slot[None, :] < lens[:, None]  # [B, L]
    gather = starts[members][:, None] + np.where(real, slot[None, :], 0)  # [B, L]
    keep = np.flatnonzero(real)  # [num_bucket_tokens], member after member
    key_mask = None if real.all() else torch.from_numpy(real)[:, None, None, :].to(device)
    return SequenceBucket(
        seq_ids=tuple(members),
        padded_len=padded_len,
        gather_index=torch.from_numpy(gather.reshape(-1)).to(device, non_blocking=True),
        keep_index=torch.from_numpy(keep).to(device, non_blocking=True),
        stream_index=torch.from_numpy(gather.reshape(-1)[keep]).to(device, non_blocking=True),
        key_mask=key_mask,
    )


def build_bucket_layout(
    seq_lens_q: Sequence[int],
    context_lens: Sequence[int],
    query_starts: Sequence[int],
    device: torch.device,
) -> BucketLayout:
    """Buckets of the sequences without cached keys; every other sequence is attended alone."""
    lens_q = np.asarray(seq_lens_q, dtype=np.int64)
    starts = np.asarray(query_starts, dtype=np.int64)
    # Cached keys make a sequence's key count differ from its query count: those stay alone.
    batchable = np.asarray(context_lens, dtype=np.int64) == 0
    groups = _groups(lens_q, batchable)
    grouped = {i for g in groups for i in g}
    buckets = tuple(_bucket(g, lens_q, starts, device) for g in groups if len(g) > 1)
    single = sorted(
        [i for g in groups if len(g) == 1 for i in g]
        + [i for i in range(len(lens_q)) if i not in grouped]
    )
    return BucketLayout(buckets=buckets, single=tuple(single))
