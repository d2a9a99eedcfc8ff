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
# The variables that cap a kernel library below the CPU it runs on, by library: with torch's
# ATEN_CPU_CAPABILITY=avx2, these at AVX2 make an AVX-512 CPU with VNNI compute like one with AVX2
# only (fbgemm's and oneDNN's int8 GEMMs then add products in saturating int16 pairs, and MKL's
# float32 GEMM, torch's own, runs at AVX2's width: uncapped it kept 1.6x of its speed).
CAP_VARIABLES = {
    "oneDNN": "ONEDNN_MAX_CPU_ISA",
    "fbgemm": "FBGEMM_ENABLE_INSTRUCTIONS",
    "MKL": "MKL_ENABLE_INSTRUCTIONS",
}


@dataclass(frozen=True)
class CpuClass:
    """A CPU as the kernels see it: torch's kernel ISA, oneDNN's cap, the units it has."""

    model_name: str
    isa: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, ... (ATEN_CPU_CAPABILITY)
    caps: tuple[tuple[str, str], ...]  # (library, ISA) of CAP_VARIABLES set: it stops there
    units: tuple[str, ...]  # of UNITS' names, usable at that ISA

    def __str__(self) -> str:
        """e.g. 'AVX512 + VNNI + BF16 (AMD EPYC)', 'AVX2 (Intel Xeon, oneDNN capped at AVX2)'."""
        parts = [self.isa, *self.units]
        caps = "".join(f", {library} capped at {isa}" for library, isa in self.caps)
        return f"{' + '.join(parts)} ({self.model_name}{caps})"


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
    caps = tuple(
        (library, os.environ[variable].upper())
        for library, variable in CAP_VARIABLES.items()
        if os.environ.get(variable)
    )
    below = isa.upper() in _BELOW_AVX512 or any(_below_avx512(cap) for _, cap in caps)
    unusable = ("avx512", "amx") if below else ()
    if any(cap == "AVX2" for _, cap in caps):  # plain AVX2: not AVX2_VNNI's dot products either
        unusable = (*unusable, "avx_vnni")
    flags = cpu_flags()
    units = tuple(
        unit
        for unit, wanted in UNITS.items()
        if any(f in flags and not f.startswith(unusable) for f in wanted)
    )
    return CpuClass(_model_name(), isa, caps, units)


def cpu_lacks_native(dtype: torch.dtype) -> str | None:
    """Why the CPU would emulate a half dtype (slower than float32), or None when native."""
    wanted = NATIVE_CPU_FLAGS.get(dtype)
    if wanted is None or not cpu_flags().isdisjoint(wanted):
        return None
    name = str(dtype).removeprefix("torch.")
    return f"this CPU has no native {name} units ({' or '.join(wanted)})"


def _below_avx512(cap: str) -> bool:
    """A library's cap names an ISA below AVX-512 (e.g. AVX2, AVX2_VNNI)."""
    return not cap.startswith(("AVX512", "AVX10", "ALL", "DEFAULT"))


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
