"""Plain counters the engine exports: bytes cloned for buffer ownership, live poolers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CloneStats:
    """Mutable counters, one instance per engine (never a module-level global)."""

    cloned_bytes: int = 0
    num_clones: int = 0
    # Poolers built and not yet finished or closed; zero after a drain unless state leaked.
    num_open_poolers: int = 0

    def record_clone(self, tensor: torch.Tensor) -> None:
        """Count one clone of `tensor` (its bytes)."""
        self.cloned_bytes += tensor.numel() * tensor.element_size()
        self.num_clones += 1
