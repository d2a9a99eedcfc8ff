"""Debian's wrk as the load generator: one run, and its `--latency` summary read."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Milliseconds per unit of wrk's time formatting (its units.c: us, ms, s, m, h).
TIME_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}
_TIME = r"([\d.]+)(us|ms|s|m|h)"
_PERCENTILE = re.compile(rf"^\s+(50|75|90|99)%\s+{_TIME}\s*$", re.MULTILINE)
_TOTAL = re.compile(rf"^\s+(\d+) requests in {_TIME},", re.MULTILINE)
_RATE = re.compile(r"^Requests/sec:\s+([\d.]+)\s*$", re.MULTILINE)
_NON_2XX = re.compile(r"^\s+Non-2xx or 3xx responses: (\d+)\s*$", re.MULTILINE)
_SOCKET = re.compile(
    r"^\s+Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)\s*$", re.MULTILINE
)


class WrkOutputError(ValueError):
    """wrk printed no summary (it could not connect, or was killed)."""


@dataclass(frozen=True)
class WrkResult:
    """What one wrk --latency run reports."""

    requests: int  # responses completed, whatever their status
    duration_s: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int  # statuses >= 400 (wrk's "Non-2xx or 3xx responses")
    socket_errors: int  # connect + read + write + timeout

    @property
    def errors(self) -> int:
        """Every request that did not end in a success."""
        return self.non_2xx + self.socket_errors


def _ms(value: str, unit: str) -> float:
    return float(value) * TIME_UNITS_MS[unit]


def parse_wrk(text: str) -> WrkResult:
    """Read `wrk --latency` output; WrkOutputError when it has no summary."""
    total, rate = _TOTAL.search(text), _RATE.search(text)
    percentiles = {m[1]: _ms(m[2], m[3]) for m in _PERCENTILE.finditer(text)}
    if total is None or rate is None or not {"50", "99"} <= percentiles.keys():
        raise WrkOutputError(f"no wrk summary in: {text[-500:]!r}")
    non_2xx = _NON_2XX.search(text)
    sockets = _SOCKET.search(text)
    return WrkResult(
        requests=int(total[1]),
        duration_s=_ms(total[2], total[3]) / 1e3,
        requests_per_s=float(rate[1]),
        p50_ms=percentiles["50"],
        p99_ms=percentiles["99"],
        non_2xx=int(non_2xx[1]) if non_2xx else 0,
        socket_errors=sum(int(n) for n in sockets.groups()) if sockets else 0,
    )


def write_script(path: Path, body: str) -> Path:
    """wrk's Lua script: every request POSTs the same JSON body."""
    path.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [==[{body}]==]\n"
    )
    return path


def run_wrk(url: str, script: Path, concurrency: int, seconds: int) -> tuple[WrkResult, str]:
    """One wrk run (one thread); its parsed summary and its output."""
    command = ["wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s", "--timeout", "30s"]
    done = subprocess.run(
        [*command, "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=False,
    )
    return parse_wrk(done.stdout + done.stderr), done.stdout
