"""Length buckets of one step: short sequences of one length attended in one batched SDPA call.

Measured on the 2-core CPU (MiniLM, float32, whole forwards): an SDPA call has a fixed cost
(dispatch, the kernel's buffers, a fork and join of the threads) that dominates on prompts of a
few tokens, where one call per bucket made the forward 1.17x faster (2-10-token prompts, 2
threads). Padding to the longest member did worse than equal lengths on every mix, and worse
than one call per sequence single-threaded: the padded scores and the key mask SDPA then needs
cost more than the calls saved. Past a few dozen tokens the bucket's gathers of queries, keys and
values cost more than the calls saved (with 512-token buckets the forward was 1.6% slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Longest sequence that joins a bucket: past it, gathering its rows costs more than its call.
MAX_BUCKET_LEN = 32


@dataclass(frozen=True)
class SequenceBucket:
    """Sequences of one length, without cached keys, attended as one batch."""

    seq_ids: tuple[int, ...]  # sequence indices of the members, in step order
    seq_len: int  # every member's number of tokens
    token_index: torch.Tensor  # [num_members * seq_len] int64 stream index, member after member

    @property
    def num_seqs(self) -> int:
        """Members of the bucket."""
        return len(self.seq_ids)


@dataclass(frozen=True)
class BucketLayout:
    """How a step's sequences are attended: batched buckets, and sequences attended alone."""

    buckets: tuple[SequenceBucket, ...]
    single: tuple[int, ...]  # cached context, long, or alone at its length: one call each


def build_bucket_layout(
    seq_lens_q: Sequence[int],
    context_lens: Sequence[int],
    query_starts: Sequence[int],
    device: torch.device,
) -> BucketLayout:
    """Short sequences without cached keys grouped by length; the rest is attended alone."""
    by_length: dict[int, list[int]] = {}
    single: list[int] = []
    for i, (num_new, num_context) in enumerate(zip(seq_lens_q, context_lens, strict=True)):
        # Cached keys make a sequence's key count differ from its query count: those stay alone.
        if num_context or num_new > MAX_BUCKET_LEN:
            single.append(i)
        else:
            by_length.setdefault(num_new, []).append(i)
    buckets = []
    for length, members in by_length.items():
        if len(members) == 1:
            single.extend(members)
            continue
        starts = np.asarray([query_starts[i] for i in members], dtype=np.int64)  # [B]
        index = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]  # [B, seq_len]
        buckets.append(
            SequenceBucket(
                seq_ids=tuple(members),
                seq_len=length,
                token_index=torch.from_numpy(index.reshape(-1)).to(device, non_blocking=True),
            )
        )
    return BucketLayout(buckets=tuple(buckets), single=tuple(sorted(single)))
