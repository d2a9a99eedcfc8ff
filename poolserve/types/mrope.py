"""Where a vision-language prompt's images sit among its tokens, and its M-RoPE positions.

Qwen-VL decoders give each token three positions (frame, row, column). A text token has its
index on all three, counted on from the position after what came before it; an image's
tokens take their merged patch's frame, row and column added to the position where the image
starts, and the text after an image goes on from one past the image's largest position
(transformers' `get_rope_index`, images only); a model run without them (ColQwen2) counts
every token by its index. Torch-free: the engine computes them once per
prompt at admission, and any chunk's slice of them is its positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poolserve.types.vision import Grid, InlineImages


def image_starts(token_ids: np.ndarray, grids: Sequence[Grid], inline: InlineImages) -> list[int]:
    """Where each image's run of placeholders starts; raises ValueError unless the prompt's
    placeholders are exactly one run per image, of the length its grid gives, in order."""
    is_image = token_ids == inline.image_token_id  # [num_tokens]
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8), prepend=0, append=0))
    starts, ends = edges[0::2], edges[1::2]
    lengths = [inline.num_tokens(grid) for grid in grids]
    if len(starts) != len(grids) or any(
        int(end - start) != length for start, end, length in zip(starts, ends, lengths, strict=True)
    ):
        runs = [int(end - start) for start, end in zip(starts, ends, strict=True)]
        raise ValueError(
            f"the prompt's image placeholder runs {runs} do not match its images' {lengths}"
        )
    return [int(start) for start in starts]


def mrope_positions(
    num_tokens: int, starts: Sequence[int], grids: Sequence[Grid], merge_size: int
) -> np.ndarray:  # [3, num_tokens] int64
    """The three position rows of a prompt whose images' placeholder runs start at `starts`."""
    positions = np.empty((3, num_tokens), dtype=np.int64)
    cursor = 0  # the next token to place
    next_position = 0  # the position the next text token takes
    for start, (frames, rows, cols) in zip(starts, grids, strict=True):
        text = start - cursor
        positions[:, cursor:start] = np.arange(next_position, next_position + text)
        next_position += text
        rows, cols = rows // merge_size, cols // merge_size
        t, h, w = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(cols), indexing="ij")
        end = start + frames * rows * cols
        positions[:, start:end] = np.stack([t, h, w]).reshape(3, -1) + next_position
        next_position += max(rows, cols)
        cursor = end
    positions[:, cursor:] = np.arange(next_position, next_position + num_tokens - cursor)
    return positions


def prompt_positions(
    num_tokens: int, starts: Sequence[int], grids: Sequence[Grid], inline: InlineImages
) -> np.ndarray:  # [3, num_tokens] int64
    """The prompt's position rows: M-RoPE's, or, for a model run without them (`inline.mrope`
    false: ColQwen2, whose transformers forward gives its model no image grids), each token's
    index on all three rows."""
    if inline.mrope:
        return mrope_positions(num_tokens, starts, grids, inline.processing.merge_size)
    return np.broadcast_to(np.arange(num_tokens, dtype=np.int64), (3, num_tokens)).copy()
