"""The int8 projections' input ranges, measured at load, and the smoothing they give (SmoothQuant).

A norm's output, the input of qkv and of the MLP's up (or gate/up) projection, has a few channels
many times wider than the rest. A per-token int8 scale is set by those channels and leaves the
others a handful of levels: on MiniLM, qkv in int8 alone brings the worst text's cosine to float32
down to 0.992. Dividing input channel j by s_j and multiplying the weight's column j by s_j leaves
x @ W.T unchanged and moves the range into the weight, whose scale is per output channel and
whose columns are narrow: s_j = max|x_j|^ALPHA / max|W_j|^(1 - ALPHA) (Xiao et al., SmoothQuant).
With it, qkv runs in int8 too, and MiniLM's worst cosine with every projection in int8 is 0.9967
(0.9971 before, with qkv in float32; with 7-bit activations 0.9972 against 0.9960), for 1.5-1.7x
float32's speed instead of 1.25x (MiniLM, AVX-512; docs/models.md, Precision). The strength is
SmoothQuant's default: 0.7 gave MiniLM 0.9974 but a tiny random Qwen2's last token 0.995 against
0.999.

max|x_j| is measured once, at load: the backbone runs CALIBRATION random token ids of its
vocabulary (fixed seed: two loads quantize alike), each smoothed slot's input range recorded. A
norm's wide channels are a property of the weights, not of the text: on MiniLM random ids gave
the ranges real texts gave (worst cosine 0.9974 both), and 64 to 512 ids gave 0.9966 to 0.9976.
The activation's outputs (the down projection's input) and attention's (o's) are not smoothed:
there it did not help (o: 0.9972) or hurt (down: 0.988).

Only a float32 model is smoothed (`smooths`). In bfloat16 compute the int8 qkv's error
adds to bfloat16's own (a tiny random Llama's last token: 0.992 against 0.998 in float32) for
less gain, bfloat16's GEMM being 2x float32's already: there qkv keeps bfloat16, as before.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from poolserve.models.attention import build_attention_metadata
from poolserve.models.packed import PackedModel
from poolserve.models.quantization import buffer_name

logger = logging.getLogger(__name__)

# The projections fed by a norm's output (buffer names of the decoder and encoder layers).
SMOOTHED_WEIGHTS = ("qkv_weight", "gate_up_weight", "up_weight")
ALPHA = 0.5  # SmoothQuant's migration strength (the docstring: why not 0.7)
CALIBRATION = (2, 64)  # sequences x tokens: MiniLM in 0.05 s, Qwen3-0.6B's geometry in 1.7 s
_SEED = 0
_BLOCK_SIZE = 16  # attention metadata's page size; nothing is cached
_TINY = 1e-5  # floor of a range or column max: a dead channel keeps s_j finite


def smooths(dtype: torch.dtype) -> bool:
    """Whether int8 smooths a model computing in `dtype` (and so quantizes its qkv)."""
    return dtype == torch.float32


class _RangeRecorder(torch.nn.Module):
    """Stands in a projection's slot while calibrating: its float output, and max |x| per input
    channel over every call."""

    def __init__(self, weight: torch.Tensor) -> None:  # [out, in]
        super().__init__()
        self.weight = weight
        self.range: torch.Tensor | None = None  # [in] float32

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen = x.abs().amax(0).float()  # [in]
        self.range = seen if self.range is None else torch.maximum(self.range, seen)
        return F.linear(x, self.weight, bias)


def measure_smoothing(model: PackedModel, causal: bool) -> dict[str, torch.Tensor]:
    """Each smoothed projection's s [in], by its buffer's name in the model."""
    start = time.perf_counter()
    ranges = measure_input_ranges(model, causal)
    factors = {name: smoothing(found, weight) for name, (found, weight) in ranges.items()}
    logger.info(
        "int8: %d projections smoothed, their input ranges measured on %d random tokens in %.2f s",
        len(factors),
        math.prod(CALIBRATION),
        time.perf_counter() - start,
    )
    return factors


def measure_input_ranges(
    model: PackedModel, causal: bool
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each smoothed projection's max |input| per channel [in] and its weight [out, in], by its
    buffer's name in the model."""
    device = next(model.buffers()).device
    num_sequences, length = CALIBRATION
    ids = calibration_ids(model.vocab_size).flatten()  # [num_tokens]
    positions = torch.arange(length).repeat(num_sequences)  # [num_tokens]
    if model.position_rows > 1:  # M-RoPE: a text's rows are its plain positions
        positions = positions.expand(model.position_rows, -1)
    meta = build_attention_metadata(
        seq_lens_q=[length] * num_sequences,
        context_lens=[0] * num_sequences,
        write_kv=[False] * num_sequences,
        block_tables=[()] * num_sequences,
        block_size=_BLOCK_SIZE,
        device=device,
        causal=causal,
    )
    with _recorders(model) as recorders, torch.inference_mode():
        model(ids.to(device), positions.to(device), meta, None)
    return {name: (r.range, r.weight) for name, r in recorders.items() if r.range is not None}


def calibration_ids(vocab_size: int) -> torch.Tensor:  # [sequences, tokens] int64
    """The token ids the ranges are measured on: random over the vocabulary, seeded."""
    generator = torch.Generator().manual_seed(_SEED)
    return torch.randint(0, vocab_size, CALIBRATION, generator=generator)


def smoothing(input_range: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [in], [out, in]
    """s [in]: input channel j is divided by s_j and the weight's column j multiplied by it."""
    columns = weight.float().abs().amax(0).clamp_min(_TINY)  # [in]
    activations = input_range.float().clamp_min(_TINY)
    return (activations.pow(ALPHA) / columns.pow(1 - ALPHA)).clamp_min(_TINY)


@contextmanager
def _recorders(model: torch.nn.Module) -> Iterator[dict[str, _RangeRecorder]]:
    """Every smoothed slot's plain weight behind a recorder, put back on exit."""
    slots = [
        (prefix, module, slot)
        for prefix, module in model.named_modules()
        for slot in SMOOTHED_WEIGHTS
        if type(module._buffers.get(slot)) is torch.Tensor
    ]
    recorders: dict[str, _RangeRecorder] = {}
    for prefix, module, slot in slots:
        recorder = _RangeRecorder(module._buffers[slot])
        delattr(module, slot)  # the slot becomes a submodule of the same name while measuring
        module.add_module(slot, recorder)
        recorders[buffer_name(prefix, slot)] = recorder
    try:
        yield recorders
    finally:
        for prefix, module, slot in slots:
            weight = recorders[buffer_name(prefix, slot)].weight
            delattr(module, slot)
            module.register_buffer(slot, weight)
