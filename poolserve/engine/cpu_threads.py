"""How many CPU threads one step's forward gets: enough work for each, or one.

A thread that runs out of work sleeps (the server sets OpenMP's passive wait policy so that idle
pool threads leave the cores to the front ends), and every parallel operator then wakes it again:
tens of microseconds per operator, more than a small operator's whole work. Measured on 2 cores
(`python -m bench step-threads`, docs/benchmarks.md): a step of the front-end bench's tiny BERT
ran faster on one thread at every size up to 64 prompts (1.06 against 2.31 ms for one prompt),
and the real all-MiniLM-L6-v2 (21 MFLOP a token) ran one 16-token prompt in 10.6 ms on one
thread against 14.5 ms on two, broke even at 4 prompts and gained 1.5x from two threads at 16.
So a step gets one thread per `FLOPS_PER_THREAD` of its estimated work, at least one and at most
the process's torch thread count (OMP_NUM_THREADS or torch's default), the way torch's own grain
size keeps small element-wise operators on one thread. Only CPU devices: a GPU's forward does
not run on these threads.
"""

from __future__ import annotations

import torch

# About 15 ms of one core's float32 matmul work on the machine measured: MiniLM's break-even at
# 4 prompts of 16 tokens is 1.4 GFLOP for two threads; below one share a step runs on one thread.
FLOPS_PER_THREAD = 512e6


def matmul_flops_per_token(model: torch.nn.Module) -> int:
    """2 FLOPs per weight of every matrix in the model's layers (the forward's matmuls).

    The layers hold their weights as buffers (plain, quantized or the int8 module's); embedding
    tables are lookups and heads run on pooled rows only, so neither counts.
    """
    layers = getattr(model, "layers", model)
    tensors = [*layers.parameters(), *layers.buffers()]
    return 2 * sum(tensor.numel() for tensor in tensors if tensor.dim() >= 2)


class StepThreads:
    """Sets the forward thread's torch thread count for each step (call on that thread)."""

    def __init__(self, flops_per_token: int, max_threads: int) -> None:
        self.flops_per_token = flops_per_token
        self.max_threads = max(1, max_threads)
        self._current: int | None = None  # the forward thread's count, read on its first step

    def threads_for(self, num_tokens: int, extra_flops: int = 0) -> int:
        """Threads for a step of `num_tokens` (and `extra_flops` of other work: a vision
        tower's images): one per FLOPS_PER_THREAD of work, 1..max."""
        wanted = int((num_tokens * self.flops_per_token + extra_flops) // FLOPS_PER_THREAD)
        return min(self.max_threads, max(1, wanted))

    def apply(self, num_tokens: int, extra_flops: int = 0) -> None:
        """Give the coming forward its threads; a no-op when the count does not change."""
        threads = self.threads_for(num_tokens, extra_flops)
        if self._current is None:
            self._current = torch.get_num_threads()  # OpenMP's count is per calling thread
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads
