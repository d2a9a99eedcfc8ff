"""SigLIP 2's naflex image embeddings: patches of any grid, positions resized to each image.

Each image arrives as its (rows, cols) grid of flattened patches, the step's images zero-padded
to the longest. Patches go through a Linear; the learned square grid of positions is resized to
each image's grid as transformers' Siglip2VisionEmbeddings resizes it: the weights of an
antialiased bilinear resize (`F.interpolate(mode="bilinear", align_corners=False,
antialias=True)`) along each axis, in float32, applied as one matmul. Not F.interpolate itself:
its CPU kernel gives every row of a one-column grid the first row's values. The key mask keeps
every attention (the layers' and the pooling head's) off the padding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from poolserve.types.errors import ModelLoadError


class NaflexEmbeddings(torch.nn.Module):
    """Patch embeddings plus positions resized per image, and the mask of real patches."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.weight = state[f"{prefix}patch_embedding.weight"]  # [hidden, patch_width]
        self.bias = state[f"{prefix}patch_embedding.bias"]
        positions = state[f"{prefix}position_embedding.weight"]  # [side * side, hidden]
        side = math.isqrt(positions.shape[0])
        if side * side != positions.shape[0]:
            raise ModelLoadError(f"{positions.shape[0]} position embeddings: not a square grid")
        self.side = side
        self.table = positions.float()  # [side * side, hidden], float32 as transformers resizes

    @property
    def patch_width(self) -> int:
        """Values in one flattened patch."""
        return int(self.weight.shape[1])

    def forward(
        self, pixels: torch.Tensor, grids: tuple[tuple[int, int], ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, N, patch_width] -> [B, N, hidden], [B, N]
        """Each image's embedded patches with its positions, and which of its rows are real."""
        if len(grids) != pixels.shape[0]:
            raise ValueError(f"{pixels.shape[0]} naflex images with {len(grids)} grids")
        x = F.linear(pixels.to(self.weight.dtype), self.weight, self.bias)
        length = pixels.shape[1]
        steps = torch.arange(length, device=pixels.device)
        counts = torch.tensor([rows * cols for rows, cols in grids], device=pixels.device)
        mask = steps[None, :] < counts[:, None]  # [B, N]
        resized = {grid: self.positions(grid) for grid in dict.fromkeys(grids)}
        positions = torch.zeros_like(x)
        for index, (rows, cols) in enumerate(grids):
            positions[index, : rows * cols] = resized[(rows, cols)]
        return x + positions, mask

    def positions(self, grid: tuple[int, int]) -> torch.Tensor:  # -> [rows * cols, hidden]
        """The learned grid resized to (rows, cols)."""
        rows, cols = grid
        by_row = self._axis(rows)  # [rows, side]
        by_col = self._axis(cols)  # [cols, side]
        weights = (by_row[:, None, :, None] * by_col[None, :, None, :]).reshape(rows * cols, -1)
        return (weights @ self.table).to(self.weight.dtype)

    def _axis(self, size: int) -> torch.Tensor:  # -> [size, side] float32
        """Each output position's weights over the grid's positions along one axis (a triangle
        widened by the scale when shrinking, as antialiasing does), summing to one."""
        device = self.table.device
        scale = self.side / torch.tensor(float(size), device=device)
        support = scale.clamp(min=1)
        center = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) * scale - 0.5
        source = torch.arange(self.side, device=device, dtype=torch.float32)
        weights = (1 - (source - center[:, None]).abs() / support).clamp(min=0)
        return weights / weights.sum(-1, keepdim=True)
