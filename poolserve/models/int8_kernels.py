"""The CPU int8 GEMMs one int8 scheme can run on: each returns the exact integer sums.

The scheme (quantization.py's Int8Linear) is fixed: int8 weights with a float32 scale per output
channel, activations rounded per token to integers in [-levels, levels]. What varies by CPU is
which GEMM computes `sum(q_x * q_w)` fastest, or at all:

- `int_mm`: torch's int8 GEMM (`torch._int_mm`, oneDNN's s8s8 matmul). Fast with VNNI or AMX;
  on CPUs with AVX2 only it fell to a loop of 1.6 GOP/s (against float32's 45 GFLOP/s).
- `onednn-qlinear`: oneDNN's int8 linear (`onednn::qlinear_pointwise`, the op torch's x86
  inductor lowers quantized linears to) on our s8 integers at scale 1: the weight's per-channel
  scale is applied inside the GEMM, where int_mm's int32 result takes a cast and a multiply of
  its own. On AMX it ran MiniLM's qkv and up projections 2.3-2.5x faster than int_mm, with the
  same sums (4,096 tokens).
- a quantized engine's dynamic linear (`fbgemm`, `onednn`, `x86`): u8 activations times s8
  weights, 2.2x float32 on those same AVX2 CPUs. It quantizes its input per tensor, at scale 1
  and zero point `levels + 1`: the identity on our integers, so the per-token scheme, and so
  batch invariance, is kept (fbgemm and x86 take that quantization as given; for the others two
  sentinel rows holding the level range's two ends make their dynamic linear measure it).
  Without dot-product units these kernels add u8 x s8 products in int16 pairs, which saturate at
  8 bits: the reduced-range variants keep 7 (levels 63), where a pair cannot overflow.
  Their 128 levels span each token's own [min, max] (`asymmetric`), not [-max|x|, max|x|]: on
  MiniLM with AVX2 only, the worst text's cosine to float32 rose from 0.988 to 0.992-0.994.

Each kernel is checked once on the worst case before it may run (`is_exact`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

INT8_LEVELS = 127  # activations and weights in [-127, 127]
REDUCED_LEVELS = 63  # 7-bit activations: a pair of u8 x s8 products stays under 2**15
# The worst case of the exactness check: extreme rows against extreme columns, in both signs.
_CHECK_DEPTH = 64
# Engines whose packed weights run a linear on an input quantization given by the caller (no
# min/max pass over the input: 5-20% less time than their dynamic linear at MiniLM's shapes).
_GIVEN_QUANTIZATION = frozenset({"fbgemm", "x86"})


def _linear_given_quantization(x: torch.Tensor, scale: float, zero_point: int, packed: Any) -> Any:
    """quantize(x, scale, zero_point) @ the packed int8 weight, dequantized to float32."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
    return op(x, scale, zero_point, packed)


# oneDNN's int8 linear, by the name the kernel list gives it (it is no quantized engine).
QLINEAR = "onednn-qlinear"


@dataclass(frozen=True)
class Int8Kernel:
    """One int8 GEMM: `engine` None is torch._int_mm, QLINEAR oneDNN's int8 linear; else a
    quantized engine's dynamic linear."""

    engine: str | None
    levels: int

    @property
    def asymmetric(self) -> bool:
        """7-bit activations span each token's own [min, max] rather than [-max|x|, max|x|]:
        a skewed input (an MLP's GELU output, mostly above -0.17) keeps about one more bit."""
        return self.levels != INT8_LEVELS

    @property
    def name(self) -> str:
        """e.g. 'int_mm', 'fbgemm', 'onednn 7-bit'."""
        base = self.engine or "int_mm"
        return base if self.levels == INT8_LEVELS else f"{base} 7-bit"

    def pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> Any:  # [out, in] int8, [out]
        """The weight as `matmul` takes it (int_mm: transposed; the others: prepacked)."""
        if self.engine is None:
            return qweight.t(), scale  # [in, out], [out]
        zeros = torch.zeros(qweight.shape[0], dtype=torch.long)
        if self.engine == QLINEAR:
            return torch.ops.onednn.qlinear_prepack(qweight, None), scale, zeros
        with _engine(self.engine), warnings.catch_warnings():
            # torch marks its quantized tensors deprecated; a removal shows as a failed check
            warnings.simplefilter("ignore")
            quantized = torch._make_per_channel_quantized_tensor(qweight, scale.double(), zeros, 0)
            return torch.ops.quantized.linear_prepack(quantized, None)

    def matmul(
        self,
        x: torch.Tensor,  # [num_tokens, in] float32
        x_scale: torch.Tensor,  # [num_tokens, 1] float32: each token's step
        packed: Any,
        offset: torch.Tensor | None = None,  # [num_tokens, 1]: asymmetric kernels' shift
        in_place: bool = False,  # x is the caller's scratch: the symmetric kernels overwrite it
        scratch: Scratch | None = None,  # the buffers for the scaled input (None: new ones)
    ) -> torch.Tensor:  # [num_tokens, out] float32
        """sum over `in` of round(x / x_scale - offset) * qweight, times the weight's scale per
        channel (offset None: 0)."""
        scratch = Scratch() if scratch is None else scratch
        if self.engine is None or self.engine == QLINEAR:
            # the rounded integers in this thread's reusable buffers, not in new tensors
            scaled = x if in_place else scratch.get(x.shape, torch.float32, "scaled")
            torch.div(x, x_scale, out=scaled).round_()
            q = scratch.get(x.shape, torch.int8, "integers").copy_(scaled)  # [num_tokens, in]
        if self.engine is None:
            weight, scale = packed
            return torch.mul(torch._int_mm(q, weight), scale)  # int32 -> float32 in one pass
        if self.engine == QLINEAR:
            weight, scale, zeros = packed
            # s8 activations at scale 1, zero point 0: the op returns the sums weight-scaled
            return torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, weight, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )
        # the engine rounds x / x_scale itself, quantizing it with scale 1 and zero point
        # levels + 1: the identity on [-levels - 1, levels], so the per-token integers are what
        # it multiplies. fbgemm's and x86's packed weights take that quantization as given;
        # the others' dynamic linear measures it, so two sentinel rows hold the range's ends.
        num_tokens = x.shape[0]
        sentinels = 0 if self.engine in _GIVEN_QUANTIZATION else 2
        scaled = scratch.get((num_tokens + sentinels, x.shape[1]), torch.float32, "scaled")
        if offset is None:
            torch.div(x, x_scale, out=scaled[:num_tokens])
        else:  # x / x_scale - offset in one pass
            torch.addcmul(offset.neg(), x, x_scale.reciprocal(), out=scaled[:num_tokens])
        if not sentinels:
            return _linear_given_quantization(scaled, 1.0, self.levels + 1, packed)
        scaled[num_tokens].fill_(-self.levels - 1.0)
        scaled[num_tokens + 1].fill_(float(self.levels))
        reduce_range = self.levels != INT8_LEVELS
        return torch.ops.quantized.linear_dynamic(scaled, packed, reduce_range)[:num_tokens]


class Scratch(threading.local):
    """Reusable buffers for the int8 GEMMs' inputs, by purpose, each grown to the largest asked
    for and kept: a projection's scaled and rounded input is used once, within the call.

    A new tensor of a step's size is a fresh mapping under the server's fixed mmap threshold
    (docs/deploy.md, Memory), faulted in page by page on every step: for Qwen3-0.6B's geometry,
    about 2 GB a 2,048-token step for int8's inputs alone. One is shared by a model's
    projections (quantize_linears), which run one after another; its buffers are per thread,
    so two threads running one model never write the same memory.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, shape: Sequence[int], dtype: torch.dtype, purpose: str) -> torch.Tensor:
        """A tensor of `shape` on this thread's buffer for `purpose` (contents undefined; it
        holds until this thread's next request for the same purpose)."""
        rows, cols = shape
        key = (purpose, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < rows * cols:
            with torch.inference_mode(False):  # a plain tensor, written in inference mode or out
                buffer = torch.empty(rows * cols, dtype=dtype)
            self.buffers[key] = buffer
        return buffer[: rows * cols].view(rows, cols)


def kernels() -> tuple[Int8Kernel, ...]:
    """Every int8 GEMM this torch build has, full range before reduced."""
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    full = [Int8Kernel(name, INT8_LEVELS) for name in (None, QLINEAR, *engines)]
    # qnnpack ignores reduce_range (it says so in a warning at every call): no 7-bit variant
    reduced = [Int8Kernel(e, REDUCED_LEVELS) for e in engines if e != "qnnpack"]
    return (*full, *reduced)


def is_exact(kernel: Int8Kernel) -> bool:
    """The kernel returns exact sums on the worst case (all products at the extremes)."""
    levels = kernel.levels
    # rows: all +levels, all -levels, alternating; columns: all +127, all -127, alternating
    sign = torch.tensor([1.0, -1.0]).repeat(_CHECK_DEPTH // 2)  # [depth]
    q = torch.stack((torch.ones(_CHECK_DEPTH), -torch.ones(_CHECK_DEPTH), sign)) * levels
    w = torch.stack((torch.ones(_CHECK_DEPTH), -torch.ones(_CHECK_DEPTH), sign)) * INT8_LEVELS
    want = q.double() @ w.double().t()  # [3, 3], exact in float32 too (under 2**24)
    ones = torch.ones(3)
    try:
        got = kernel.matmul(q, ones[:, None], kernel.pack(w.to(torch.int8), ones))
    except (RuntimeError, NotImplementedError, AttributeError):  # absent from this build
        return False
    return bool((got.double() == want).all())


class _engine:
    """Sets torch's quantized engine for a prepack, and restores it (prepacked weights keep it)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.previous = torch.backends.quantized.engine

    def __enter__(self) -> None:
        torch.backends.quantized.engine = self.engine

    def __exit__(self, *exc_info: object) -> None:
        torch.backends.quantized.engine = self.previous
