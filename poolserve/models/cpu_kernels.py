"""CPU kernels measured at load: the fastest faithful one runs, a precision not worth it is refused.

What a precision is worth depends on the CPU class (cpu_class.py): bfloat16 is 1.5-2x float32
with native units and 0.2x without; int8 through `torch._int_mm` is 2x float32 with VNNI and
0.04x on CPUs with AVX2 only, where a quantized engine's 7-bit GEMM is 1.1-1.2x. So at load, on
the model's projection shapes and this CPU, the float GEMMs (float_kernels.py) and, for int8, the
exact int8 GEMMs (int8_kernels.py) are timed against float32 (0.1 to 0.3 s for MiniLM-to-Qwen3-0.6B
shapes, up to 1.5 s with int8), and the fastest faithful one runs. A precision whose fastest
kernel does not reach its floor (MIN_SPEEDUP: a half dtype must not be slower than float32, int8
must be 1.5x) is refused in one line, unless the operator passed `allow_slower` (then it runs,
and a warning says by how much). `--dtype auto` is float32 on the CPU, the only precision within
the float32 tolerance of the equivalence tests: only its kernel is chosen.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from poolserve.models.cpu_class import NATIVE_CPU_FLAGS, CpuClass, cpu_class, cpu_lacks_native
from poolserve.models.float_kernels import KERNELS as FLOAT_KERNELS
from poolserve.models.float_kernels import TORCH, FloatKernel, is_close
from poolserve.models.int8_kernels import Int8Kernel, Scratch, is_exact
from poolserve.models.int8_kernels import kernels as int8_kernels
from poolserve.models.layers import linear
from poolserve.models.quantization import (
    PROJECTION_WEIGHTS,
    QUANTIZED_WEIGHTS,
    SMOOTHED_ONLY,
    Int8Linear,
)
from poolserve.models.smoothing import SMOOTHED_WEIGHTS, smooths
from poolserve.types.errors import SlowerPrecisionError

logger = logging.getLogger(__name__)

# One timed call's work on the largest projection, which sets the token count: enough rows for
# the kernels' steady speed, little enough that the whole measurement stays well under a second.
TIMED_FLOPS = 0.4e9
TOKEN_RANGE = (16, 256)
REPEATS = 3  # each candidate's best of this many calls, after one warm-up call
FLOAT_MARGIN = 0.05  # another float GEMM replaces torch's only when this much faster
# A layer's projections below this many FLOPs a token (the tests' tiny models) keep torch's
# float GEMM untimed; MiniLM's take 3.5 M.
MIN_KERNEL_FLOPS = 1e6
INT8 = "--quantization int8"
# The speed against float32 a precision must reach at start to run, by what it costs in
# fidelity. A half dtype's outputs stay within about 1e-4 cosine of float32's: it need only not
# be slower. int8's worst text falls to a cosine of about 0.99 (docs/models.md, Precision), a
# price for a clear gain only: its projections at 1.5x float32's (the rest of a layer runs in the
# compute dtype either way, so a whole forward gains less). AVX2's 7-bit GEMMs reach 1.1-1.2x.
MIN_SPEEDUP = {INT8: 1.5}  # any other flag: 1.0


@dataclass(frozen=True)
class PrecisionChoice:
    """What one precision measured at load, and which of its kernels runs."""

    flag: str  # as the operator asked for it: "--dtype bfloat16", "--quantization int8"
    kernel: str  # the fastest exact candidate's name
    timings: tuple[tuple[str, float], ...]  # every exact candidate's seconds, the chosen first
    float32_seconds: float  # the same projections in float32
    num_tokens: int
    cpu: CpuClass

    @property
    def floor(self) -> float:
        """The speedup this precision must reach to run (MIN_SPEEDUP)."""
        return MIN_SPEEDUP.get(self.flag, 1.0)

    @property
    def seconds(self) -> float:
        """The chosen kernel's time."""
        return self.timings[0][1]

    @property
    def speedup(self) -> float:
        """The chosen kernel's speed against float32's (above 1: faster)."""
        return self.float32_seconds / self.seconds

    def describe(self) -> str:
        """One line for the log: the choice, its ratio, and the numbers behind it."""
        others = ", ".join(f"{name} {s * 1e3:.2f}" for name, s in self.timings)
        ratio = "" if self.flag == "float32" else f": {self.speedup:.2f}x float32"
        return (
            f"{self.flag} runs {self.kernel}{ratio} on this CPU, "
            f"{self.cpu} (ms for one layer's projections on {self.num_tokens} tokens: {others}"
            + ("" if self.flag == "float32" else f"; float32 {self.float32_seconds * 1e3:.2f}")
            + ")"
        )


def choose(
    flag: str,
    tiers: Sequence[Mapping[str, float]],
    float32_seconds: float,
    num_tokens: int,
    cpu: CpuClass,
) -> PrecisionChoice:
    """The fastest candidate of the first tier with one reaching the flag's floor (MIN_SPEEDUP);
    where none does (refused, unless the operator allows it), of the first tier with one faster
    than float32, else of the most faithful tier.

    Tiers rank fidelity (int8: full range before 7-bit), so a precision's outputs stay the same
    from start to start on one CPU whatever the timings' noise; SlowerPrecisionError when no
    candidate is left (no exact kernel).
    """
    every = {name: s for tier in tiers for name, s in tier.items()}
    if not every:
        raise SlowerPrecisionError(
            f"{flag} cannot run on this CPU, {cpu}: none of its kernels is exact here"
        )
    bars = (MIN_SPEEDUP.get(flag, 1.0), 1.0)
    fast = [t for bar in bars for t in tiers if any(float32_seconds / s >= bar for s in t.values())]
    pool = fast[0] if fast else next(tier for tier in tiers if tier)
    kernel = min(pool, key=pool.__getitem__)
    return PrecisionChoice(flag, kernel, _ranked(kernel, every), float32_seconds, num_tokens, cpu)


def _ranked(kernel: str, timings: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    """The chosen kernel's timing first, then the others' from the fastest."""
    others = sorted((item for item in timings.items() if item[0] != kernel), key=lambda i: i[1])
    return ((kernel, timings[kernel]), *others)


def check_speed(choice: PrecisionChoice, allow_slower: bool, advice: str, reason: str = "") -> None:
    """Refuse a choice below its floor (one line, with the ratio and `reason` when known); warn
    when allowed."""
    if choice.speedup >= choice.floor:
        logger.info("%s", choice.describe())
        return
    floor = "" if choice.floor == 1.0 else f", below the {choice.floor:.2f}x it must reach"
    why = (
        f"{choice.flag} would run at {choice.speedup:.2f}x float32's speed on this CPU, "
        f"{choice.cpu}{floor}: its fastest kernel ({choice.kernel}) takes "
        f"{choice.seconds * 1e3:.2f} ms against float32's {choice.float32_seconds * 1e3:.2f} ms "
        f"for one layer's projections on {choice.num_tokens} tokens"
        + (f" ({reason})" if reason else "")
    )
    if not allow_slower:
        raise SlowerPrecisionError(f"{why}; {advice}, or pass --allow-slower-precision")
    logger.warning("%s; running it anyway (--allow-slower-precision)", why)


@dataclass(frozen=True)
class CpuKernels:
    """The kernels chosen for a model's projections: its float GEMM, and int8's where asked."""

    float_kernel: FloatKernel
    int8_kernel: Int8Kernel | None


def choose_kernels(
    model: torch.nn.Module,
    dtype: torch.dtype,
    quantization: str | None,
    allow_slower: bool,
) -> CpuKernels:
    """The kernels for `model`'s projections; refuses a precision below its floor.

    Call on a CPU model before quantize_linears and pack_linears: it reads the plain weights.
    """
    shapes = _projection_shapes(model)
    if not shapes:
        return CpuKernels(TORCH, None)
    measured = _measure(shapes, dtype, quantization == "int8")
    if measured.half is not None:
        advice = "use --dtype float32 (or auto)"
        check_speed(measured.half, allow_slower, advice, _emulated(dtype, measured.half.cpu))
    else:
        logger.info("%s", measured.float32.describe())
    if measured.int8 is not None:
        reason = "int8's outputs fall to a worst cosine of about 0.99 against float32's"
        check_speed(measured.int8, allow_slower, "run without --quantization", reason)
    float_kernel = FloatKernel((measured.half or measured.float32).kernel)
    return CpuKernels(float_kernel, measured.int8_kernel)


@dataclass(frozen=True)
class Measured:
    """What one measurement of a layer's projection shapes chose, per precision."""

    float32: PrecisionChoice
    half: PrecisionChoice | None  # the asked half dtype's, against float32
    int8: PrecisionChoice | None  # int8's, against float32
    int8_kernel: Int8Kernel | None


@functools.cache
def _measure(shapes: tuple[tuple[str, int, int], ...], dtype: torch.dtype, int8: bool) -> Measured:
    """Times the candidates on random weights of `shapes` (speed does not depend on values).

    Once per process and shapes: every model of these shapes loaded by one process runs the
    same kernels, so two loads of one checkpoint give the same outputs to the bit.
    """
    generator = torch.Generator().manual_seed(0)
    weights = {
        slot: torch.randn(out, inp, generator=generator) * 0.05 for slot, out, inp in shapes
    }  # [out, in] each
    num_tokens = _num_tokens(weights.values())
    inputs = _inputs(weights.values(), num_tokens)
    cpu = cpu_class()
    float32 = _choose_float(weights, inputs, torch.float32, num_tokens, cpu)
    half = None
    if dtype != torch.float32:
        half = _choose_float(weights, inputs, dtype, num_tokens, cpu)
        half = dataclasses.replace(half, float32_seconds=float32.seconds)
    if not int8:
        return Measured(float32, half, None, None)
    # the slots int8 takes in this dtype: qkv only where it is smoothed
    taken = set(QUANTIZED_WEIGHTS["int8"]) - set(() if smooths(dtype) else SMOOTHED_ONLY["int8"])
    slots = {slot: w for slot, w in weights.items() if slot in taken}
    exact = {kernel.name: kernel for kernel in int8_kernels() if is_exact(kernel)}
    tiers = [
        {name: _time_int8(slots, inputs, dtype, k) for name, k in exact.items() if k.levels == n}
        for n in sorted({k.levels for k in exact.values()}, reverse=True)
    ]
    baseline = _time_linears(slots, inputs, torch.float32, FloatKernel(float32.kernel))
    choice = choose(INT8, tiers, baseline, num_tokens, cpu)
    return Measured(float32, half, choice, exact[choice.kernel])


def _choose_float(
    weights: Mapping[str, torch.Tensor],
    inputs: Mapping[int, torch.Tensor],
    dtype: torch.dtype,
    num_tokens: int,
    cpu: CpuClass,
) -> PrecisionChoice:
    """The float GEMM for `dtype`: torch's, unless another is FLOAT_MARGIN faster.

    Float kernels differ in summation order: keeping torch's unless another is clearly faster
    keeps timing noise from moving outputs by an ulp from one start to the next.
    """
    name = str(dtype).removeprefix("torch.")
    flag = "float32" if dtype == torch.float32 else f"--dtype {name}"
    usable = [k for k in FLOAT_KERNELS if is_close(k, dtype)]
    if sum(w.numel() for w in weights.values()) * 2 < MIN_KERNEL_FLOPS:
        # a layer too small for a GEMM's speed to matter keeps torch's without timing the others
        usable = [k for k in usable if k == TORCH]
    if not usable:
        raise SlowerPrecisionError(f"{flag} cannot run on this CPU, {cpu}: no kernel of it does")
    timings = {k.name: _time_linears(weights, inputs, dtype, k) for k in usable}
    kernel = min(timings, key=timings.__getitem__)
    torch_s = timings.get(TORCH.name)
    if torch_s is not None and timings[kernel] > torch_s * (1 - FLOAT_MARGIN):
        kernel = TORCH.name
    return PrecisionChoice(flag, kernel, _ranked(kernel, timings), timings[kernel], num_tokens, cpu)


def _emulated(dtype: torch.dtype, cpu: CpuClass) -> str:
    """Why torch emulates a half dtype on this CPU class, or "" where it has the units."""
    name = str(dtype).removeprefix("torch.")
    wanted = NATIVE_CPU_FLAGS.get(dtype, ())
    native = "BF16" in cpu.units if dtype == torch.bfloat16 else cpu_lacks_native(dtype) is None
    return "" if native else f"torch emulates {name} without native units: {', '.join(wanted)}"


def _projection_shapes(model: torch.nn.Module) -> tuple[tuple[str, int, int], ...]:
    """Layer 0's plain projection weights as (slot, out, in): every layer has its shapes."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, Sequence | torch.nn.ModuleList) or len(layers) == 0:
        return ()
    buffers = dict(layers[0].named_buffers(recurse=False))
    found = [(slot, buffers[slot]) for slot in PROJECTION_WEIGHTS if slot in buffers]
    return tuple((slot, *w.shape) for slot, w in found if type(w) is torch.Tensor and w.dim() == 2)


def _num_tokens(weights: Iterable[torch.Tensor]) -> int:
    """Rows for one timed call: TIMED_FLOPS on the largest projection, a power of two in range."""
    largest = max(w.numel() for w in weights)
    rows = max(1, int(TIMED_FLOPS / (2 * largest)))
    low, high = TOKEN_RANGE
    return min(high, max(low, 1 << int(math.log2(rows))))


def _inputs(weights: Iterable[torch.Tensor], num_tokens: int) -> dict[int, torch.Tensor]:
    """One random activation [num_tokens, in] per input width (values like a norm's output)."""
    generator = torch.Generator().manual_seed(0)
    widths = {w.shape[1] for w in weights}
    return {n: torch.randn(num_tokens, n, generator=generator) for n in sorted(widths)}


def _time_linears(
    weights: Mapping[str, torch.Tensor],
    inputs: Mapping[int, torch.Tensor],
    dtype: torch.dtype,
    kernel: FloatKernel,
) -> float:
    """The projections on a float kernel in `dtype`."""
    cast = [(inputs[w.shape[1]].to(dtype), kernel.wrap(w.to(dtype))) for w in weights.values()]
    return _seconds(lambda: [linear(x, w, None) for x, w in cast])


def _time_int8(
    weights: Mapping[str, torch.Tensor],
    inputs: Mapping[int, torch.Tensor],
    dtype: torch.dtype,
    kernel: Int8Kernel,
) -> float:
    """The projections as Int8Linear on `kernel`, their input in the compute dtype, smoothed
    where the model's are (by ones: the work is the same)."""

    def smoothing(slot: str, width: int) -> torch.Tensor | None:
        return torch.ones(width) if smooths(dtype) and slot in SMOOTHED_WEIGHTS else None

    scratch = Scratch()  # shared, as a loaded model's projections share theirs
    linears = [
        (inputs[w.shape[1]].to(dtype), Int8Linear(w, kernel, smoothing(slot, w.shape[1]), scratch))
        for slot, w in weights.items()
    ]
    return _seconds(lambda: [linear(x, None) for x, linear in linears])


def _seconds(run: Callable[[], object]) -> float:
    """Best of REPEATS calls after a warm-up (the first call allocates and may pack)."""
    run()
    best = math.inf
    for _ in range(REPEATS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
