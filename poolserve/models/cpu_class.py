"""What CPU the process runs on: its kernel ISA and its bfloat16 and int8 units, named once.

The class decides which precision pays on a CPU: bfloat16 without native units is emulated
(several times slower than float32), and int8 GEMMs without dot-product units add products in
int16 pairs (which saturate) or fall back to slow loops. Benchmarks print `cpu_class()` beside
every result; the start-up kernel choice (cpu_kernels.py) names it in its refusals.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

# CPU flags (torch.cpu.get_capabilities() keys and /proc/cpuinfo names) of native units per
# dtype; without one, torch emulates the type and runs slower than float32.
NATIVE_CPU_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),  # x86 AVX-512/AMX, Arm BF16
    torch.float16: ("avx512_fp16", "amx_fp16"),
}
# The units a class lists, each by the flags that provide it.
UNITS: dict[str, tuple[str, ...]] = {
    "VNNI": ("avx512_vnni", "avx_vnni", "asimddp"),
    "AMX": ("amx_int8", "amx_bf16"),
    "BF16": NATIVE_CPU_FLAGS[torch.bfloat16],
}
# torch's kernel ISAs below AVX-512: flags of AVX-512 units do not count there (a capped run).
_BELOW_AVX512 = ("DEFAULT", "AVX2", "NO AVX")


@dataclass(frozen=True)
class CpuClass:
    """A CPU as the kernels see it: torch's kernel ISA, oneDNN's cap, the units it has."""

    model_name: str
    isa: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ... (ATEN_CPU_CAPABILITY)
    onednn_cap: str | None  # ONEDNN_MAX_CPU_ISA when set: oneDNN's kernels stop at that ISA
    units: tuple[str, ...]  # of UNITS' names, usable at that ISA

    def __str__(self) -> str:
        """e.g. 'AVX512 + VNNI + BF16 (AMD EPYC)'."""
        parts = [self.isa, *self.units]
        cap = f", oneDNN capped at {self.onednn_cap}" if self.onednn_cap else ""
        return f"{' + '.join(parts)} ({self.model_name}{cap})"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's features: torch's own capability query, plus /proc/cpuinfo's flags."""
    query = getattr(torch.cpu, "get_capabilities", dict)  # absent from older torch releases
    flags = {name for name, value in query().items() if value is True}
    text = _cpuinfo()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            flags.update(value.split())
    return frozenset(flags)


def cpu_class() -> CpuClass:
    """This process's CPU class (torch's ISA honours ATEN_CPU_CAPABILITY)."""
    isa = torch.backends.cpu.get_cpu_capability()
    capped = isa.upper() in _BELOW_AVX512 or _onednn_cap_below_avx512()
    flags = cpu_flags()
    units = tuple(
        unit
        for unit, wanted in UNITS.items()
        if any(f in flags and not (capped and f.startswith(("avx512", "amx"))) for f in wanted)
    )
    return CpuClass(_model_name(), isa, os.environ.get("ONEDNN_MAX_CPU_ISA") or None, units)


def cpu_lacks_native(dtype: torch.dtype) -> str | None:
    """Why the CPU would emulate a half dtype (slower than float32), or None when native."""
    wanted = NATIVE_CPU_FLAGS.get(dtype)
    if wanted is None or not cpu_flags().isdisjoint(wanted):
        return None
    name = str(dtype).removeprefix("torch.")
    return f"this CPU has no native {name} units ({' or '.join(wanted)})"


def _onednn_cap_below_avx512() -> bool:
    """ONEDNN_MAX_CPU_ISA names an ISA below AVX-512 (e.g. AVX2, AVX2_VNNI)."""
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return bool(cap) and not cap.startswith(("AVX512", "AVX10", "ALL", "DEFAULT"))


@functools.cache
def _cpuinfo() -> str:
    """/proc/cpuinfo's text; empty off Linux."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _model_name() -> str:
    """The CPU's marketing name (x86 'model name'; Arm has none: its implementer code)."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "CPU implementer"):
            return value.strip()
    return "unknown CPU"
