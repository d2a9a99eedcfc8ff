"""Native forwards of the Qwen2-VL, Qwen2.5-VL and Qwen3-VL vision towers.

A call takes every image of a step as one stream of patches, in the processor's order (each
image's patches in merge-block order: the merge x merge patches of one decoder token adjacent),
and gives each image's merged tokens, images in order, as the decoder's placeholders take them.
Attention stays within each image's frame (Qwen2.5-VL's windowed blocks: within each window), so
the stream is cut into segments, and the segments of one length run as one batched SDPA call:
an image's output does not depend on the images beside it. Qwen2.5-VL's transformers forward
permutes the patches into window order and back; here the windows gather their patches in that
order from the unpermuted stream (every other operation is per patch or per merged token), so
each attention sees its keys in the same order and no permutation of the hidden states is
needed. Each family's facts are one `VisionFamily` row (models/families/qwen_vl.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from poolserve.models.families.records import VisionFamily
from poolserve.models.layers import activation, rms_norm

# An image's patch grid (frames, rows, cols), as the processor's image_grid_thw
Grid = tuple[int, int, int]
# (weight, bias) of one norm or Linear, placed
Affine = tuple[torch.Tensor, torch.Tensor | None]
EPS = 1e-6  # every norm of the three towers (hard-coded in transformers, not in the config)


@dataclass(frozen=True)
class VisionOutput:
    """What the tower gives the decoder for a call's images."""

    embeds: torch.Tensor  # [num_tokens, out_hidden]: every image's merged tokens, images in order
    # Qwen3-VL: one [num_tokens, out_hidden] per deepstack layer, in layer order; others: ()
    deepstack: tuple[torch.Tensor, ...]


NORMS: dict[str, Callable[[torch.Tensor, Affine], torch.Tensor]] = {
    "layer": lambda x, norm: F.layer_norm(x, x.shape[-1:], norm[0], norm[1], EPS),
    # in float32, scaled after the cast back (Qwen2_5_VLRMSNorm)
    "rms": lambda x, norm: rms_norm(x, norm[0], EPS),
}


@dataclass(frozen=True)
class Placed:
    """The tower's state read placed: each tensor on the device in the tower's dtype."""

    state: dict[str, torch.Tensor]
    placement: tuple[torch.device, torch.dtype]

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor under `key`, placed."""
        device, dtype = self.placement
        return self.state[key].to(device=device, dtype=dtype).contiguous()

    def affine(self, prefix: str, bias: bool = True) -> Affine:
        """The weight and (where present and wanted) bias under `prefix`."""
        has_bias = bias and f"{prefix}bias" in self.state
        return self.tensor(f"{prefix}weight"), self.tensor(f"{prefix}bias") if has_bias else None


def register_matrices(module: torch.nn.Module, matrices: dict[str, Affine]) -> None:
    """The projections seen as the module's buffers too (the same tensors): what the engine
    counts to size a CPU step's threads (engine/cpu_threads.py)."""
    for name, (weight, _) in matrices.items():
        module.register_buffer(f"{name}_matrix", weight, persistent=False)


@dataclass(frozen=True)
class Rope:
    """Qwen's 2D axial rotary embedding of each patch: rows' angles, then cols', twice."""

    cos: torch.Tensor  # [num_patches, 1, head_dim] float32
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:  # [num_patches, heads, head_dim]
        """x rotated in float32, as apply_rotary_pos_emb_vision does."""
        x32 = x.float()
        half = x32.shape[-1] // 2
        rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
        return (x32 * self.cos + rotated * self.sin).to(x.dtype)


@dataclass(frozen=True)
class Segments:
    """Which patches attend to each other: segments of one length batched as one SDPA call, so
    no segment sees another's keys and each is computed as it would be alone."""

    groups: tuple[torch.Tensor, ...]  # each [num_segments, length]: patch indices, keys' order

    @staticmethod
    def of(order: torch.Tensor, lengths: Sequence[int]) -> Segments:
        """The consecutive runs of `order` of these lengths, grouped by length."""
        by_length: dict[int, list[torch.Tensor]] = {}
        for run in torch.split(order, list(lengths)):
            by_length.setdefault(run.numel(), []).append(run)
        return Segments(tuple(torch.stack(runs) for runs in by_length.values()))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention within each segment of [num_patches, heads, head_dim] q, k, v."""
        out = v.new_empty(v.shape)
        for index in self.groups:
            flat = index.flatten()
            shape = (*index.shape, *q.shape[1:])  # [num_segments, length, heads, head_dim]
            q_s, k_s, v_s = (t.index_select(0, flat).view(shape).transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q_s, k_s, v_s)  # [S, heads, L, head_dim]
            out.index_copy_(0, flat, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))
        return out


@dataclass(frozen=True)
class Layout:
    """One call's per-patch facts, shared by every block."""

    rope: Rope
    full: Segments  # each image's frames
    windows: Segments  # Qwen2.5-VL's windows; others: the same as full
    positions: torch.Tensor | None  # Qwen3-VL: [num_patches, width] learned positions


class VisionBlock(torch.nn.Module):
    """A pre-norm block: x + proj(attend(rope(qkv(norm1(x))))), then x + mlp(norm2(x))."""

    def __init__(
        self, family: VisionFamily, placed: Placed, prefix: str, num_heads: int, act: str
    ) -> None:
        super().__init__()
        self.num_heads, self.norm, self.act = num_heads, NORMS[family.norm], activation(act)
        self.norm1 = placed.affine(f"{prefix}norm1.")
        self.norm2 = placed.affine(f"{prefix}norm2.")
        self.qkv = placed.affine(f"{prefix}attn.qkv.")
        self.proj = placed.affine(f"{prefix}attn.proj.")
        keys = family.mlp
        self.up = placed.affine(f"{prefix}{keys.up}")
        self.down = placed.affine(f"{prefix}{keys.down}")
        self.gate = None if keys.gate is None else placed.affine(f"{prefix}{keys.gate}")
        matrices = {"qkv": self.qkv, "proj": self.proj, "up": self.up, "down": self.down}
        register_matrices(self, matrices | ({} if self.gate is None else {"gate": self.gate}))

    def forward(
        self, x: torch.Tensor, rope: Rope, segments: Segments
    ) -> torch.Tensor:  # [num_patches, width]
        """One block over the call's patches."""
        x = x + self.attention(self.norm(x, self.norm1), rope, segments)
        h = self.norm(x, self.norm2)
        if self.gate is None:
            return x + F.linear(self.act(F.linear(h, *self.up)), *self.down)
        gated = self.act(F.linear(h, *self.gate)) * F.linear(h, *self.up)
        return x + F.linear(gated, *self.down)

    def attention(self, h: torch.Tensor, rope: Rope, segments: Segments) -> torch.Tensor:
        """Fused qkv, rotated queries and keys, attention within each segment, the output proj."""
        num_patches = h.shape[0]
        q, k, v = F.linear(h, *self.qkv).view(num_patches, 3, self.num_heads, -1).unbind(1)
        attended = segments.attend(rope.rotate(q), rope.rotate(k), v)  # [N, heads, head_dim]
        return F.linear(attended.reshape(num_patches, -1), *self.proj)


class PatchMerger(torch.nn.Module):
    """merge x merge adjacent patches into one decoder token: norm, concat, Linear, GELU, Linear;
    a deepstack merger (postshuffle) norms the concatenated patches instead of each."""

    def __init__(
        self, family: VisionFamily, placed: Placed, prefix: str, merge: int, postshuffle: bool
    ) -> None:
        super().__init__()
        self.merge_units, self.postshuffle, self.norm_fn = merge**2, postshuffle, NORMS[family.norm]
        keys = family.merger
        self.norm = placed.affine(f"{prefix}{keys.norm}")
        self.fc1 = placed.affine(f"{prefix}{keys.fc1}")
        self.fc2 = placed.affine(f"{prefix}{keys.fc2}")
        register_matrices(self, {"fc1": self.fc1, "fc2": self.fc2})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_patches, width]
        """The merged tokens, [num_patches / merge**2, out_hidden]."""
        width = x.shape[-1] * self.merge_units
        if self.postshuffle:
            h = self.norm_fn(x.reshape(-1, width), self.norm)
        else:
            h = self.norm_fn(x, self.norm).reshape(-1, width)
        return F.linear(F.gelu(F.linear(h, *self.fc1)), *self.fc2)  # nn.GELU(): exact


def rope_frequencies(config: Any, head_dim: int) -> torch.Tensor:
    """The axial rope's inverse frequencies, [head_dim / 4] float32 (rows and cols share them;
    compute_axial_rope_parameters)."""
    rope_dim = getattr(config, "head_dim", None) or head_dim
    theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    spatial = rope_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))


def block_positions(grid: Grid, merge: int, device: torch.device) -> torch.Tensor:
    """Each patch's (row, col) in the processor's merge-block order, frame after frame,
    [t*h*w, 2] (get_vision_position_ids)."""
    t, h, w = grid
    rows, cols = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    blocks = (h // merge, merge, w // merge, merge)
    frame = [axis.reshape(blocks).transpose(1, 2).flatten() for axis in (rows, cols)]
    return torch.stack(frame, dim=-1).repeat(t, 1)


def axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2 taps into a `side`-long table and their weights for each `index` of an axis of
    `size`, bilinear with aligned corners (transformers' _interpolation_axis_taps_weights)."""
    src = index.float() * (side - 1) / max(size - 1, 1)  # [n]
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # [n, 2]
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # [n, 2]
    return taps, weights


def learned_positions(table: torch.Tensor, positions: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Qwen3-VL's square position table resized bilinearly to an image's grid, at its patches'
    (row, col) `positions`, in float32: [t*h*w, width] (fast_pos_embed_interpolate)."""
    side = int(table.shape[0] ** 0.5)
    row_taps, row_weights = axis_taps(positions[:, 0], grid[1], side)
    col_taps, col_weights = axis_taps(positions[:, 1], grid[2], side)
    taps = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)  # [n, 4]
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)  # [n, 4]
    return (F.embedding(taps, table) * weights[:, :, None]).sum(1)


def window_order(grid: Grid, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows of one image: its patches in window order ([t*h*w]: frame after
    frame, windows in raster order, each window's merged tokens in raster order, each token's
    patches together) and each window's length (get_vision_window_index at patch level)."""
    t, h, w = grid
    units_h, units_w, unit = h // merge, w // merge, merge**2
    tiles_h, tiles_w = -(-units_h // window), -(-units_w // window)
    padded = torch.full((tiles_h * window, tiles_w * window), -1, dtype=torch.long)
    padded[:units_h, :units_w] = torch.arange(units_h * units_w).view(units_h, units_w)
    tiles = padded.view(tiles_h, window, tiles_w, window).transpose(1, 2).flatten(2)
    tiles = tiles.flatten(0, 1)  # [windows, window**2] merged tokens, -1 where padded
    units = tiles[tiles >= 0]  # [units_h * units_w]
    patches = (units[:, None] * unit + torch.arange(unit)).flatten()  # [h * w]
    frames = (torch.arange(t)[:, None] * (h * w) + patches).flatten()  # [t * h * w]
    lengths = ((tiles >= 0).sum(1) * unit).tolist()
    return frames, lengths * t


class QwenVision(torch.nn.Module):
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL vision tower: patches in, merged tokens out."""

    def __init__(
        self,
        family: VisionFamily,
        vision_config: Any,
        state: dict[str, torch.Tensor],
        placement: tuple[torch.device, torch.dtype],
    ) -> None:
        super().__init__()
        self.family = f = family
        config, placed = vision_config, Placed(state, placement)
        self.placement, self.merge = placement, int(config.spatial_merge_size)
        num_heads = int(config.num_heads)
        weight, bias = placed.affine("patch_embed.proj.", bias=f.patch_bias)
        self.patch = (weight.flatten(1), bias)  # Conv3d(stride=kernel) as a Linear of a patch
        register_matrices(self, {"patch": self.patch})
        self.pos_table = placed.tensor("pos_embed.weight") if f.learned_positions else None
        self.inv_freq = rope_frequencies(config, int(getattr(config, f.width)) // num_heads)
        self.inv_freq = self.inv_freq.to(placement[0])  # [head_dim / 4]
        self.blocks = torch.nn.ModuleList(
            VisionBlock(f, placed, f"blocks.{i}.", num_heads, config.hidden_act)
            for i in range(config.depth)
        )
        full = set(config.fullatt_block_indexes) if f.windows else set(range(config.depth))
        self.windowed = tuple(i not in full for i in range(config.depth))
        # merged tokens per window side (Qwen2.5-VL); 0: no windows
        self.window = (
            int(config.window_size) // self.merge // int(config.patch_size) if f.windows else 0
        )
        self.merger = PatchMerger(f, placed, "merger.", self.merge, postshuffle=False)
        layers = list(config.deepstack_visual_indexes) if f.deepstack else []
        self.deepstack_at = {layer: layers.index(layer) for layer in layers}
        self.deepstack = torch.nn.ModuleList(
            PatchMerger(f, placed, f"deepstack_merger_list.{i}.", self.merge, postshuffle=True)
            for i in range(len(layers))
        )
        self.out_hidden = int(self.merger.fc2[0].shape[0])

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> VisionOutput:
        """patches: [sum(t*h*w), channels*temporal_patch_size*patch_size**2] (float32 from the
        processor; cast to the tower's dtype inside), in transformers' processor order; grids:
        each image's (t, h, w) in patches (image_grid_thw)."""
        device, dtype = self.placement
        grids = [(int(t), int(h), int(w)) for t, h, w in grids]
        if patches.shape[0] != sum(t * h * w for t, h, w in grids):
            raise ValueError(f"{patches.shape[0]} patches for the grids {grids}")
        if any(h % self.merge or w % self.merge for _, h, w in grids):
            raise ValueError(f"grids {grids} not in blocks of {self.merge}x{self.merge} patches")
        layout = self.layout(grids)
        x = F.linear(patches.to(device=device, dtype=dtype), *self.patch)  # [N, width]
        if layout.positions is not None:
            x = x + layout.positions.to(dtype)
        deepstack = []
        for i, block in enumerate(self.blocks):
            segments = layout.windows if self.windowed[i] else layout.full
            x = block(x, layout.rope, segments)
            if i in self.deepstack_at:
                deepstack.append(self.deepstack[self.deepstack_at[i]](x))
        return VisionOutput(self.merger(x), tuple(deepstack))

    def layout(self, grids: Sequence[Grid]) -> Layout:
        """The call's rope angles, attention segments and (Qwen3-VL) learned positions."""
        device = self.placement[0]
        positions = [block_positions(grid, self.merge, device) for grid in grids]
        rows_cols = torch.cat(positions)  # [N, 2]
        angles = (rows_cols[..., None].float() * self.inv_freq).flatten(1)  # [N, rope_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [N, 1, rope_dim]
        frames = [h * w for t, h, w in grids for _ in range(t)]
        if self.window:
            order, windows = self.window_order(grids)
            order = order.to(device)  # [N]
            full, windowed = Segments.of(order, frames), Segments.of(order, windows)
        else:
            full = windowed = Segments.of(torch.arange(rows_cols.shape[0], device=device), frames)
        table, learned = self.pos_table, None
        if table is not None:
            pairs = zip(positions, grids, strict=True)
            learned = torch.cat([learned_positions(table, p, grid) for p, grid in pairs])
        return Layout(Rope(angles.cos(), angles.sin()), full, windowed, learned)

    def window_order(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, list[int]]:
        """Every image's patches in window order (offset by the images before) and the windows'
        lengths; each frame's patches stay together, so frames are runs of this order too."""
        orders, lengths, start = [], [], 0
        for grid in grids:
            order, image_lengths = window_order(grid, self.merge, self.window)
            orders.append(order + start)
            lengths += image_lengths
            start += order.numel()
        return torch.cat(orders), lengths
