"""The supervisor's verdict on a drain: clean when every front end drained, or was ended by its
own SIGTERM while still starting (no drain handler yet: it had served nothing), and the core
stopped cleanly; anything else is a failure."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from poolserve.supervisor import Plan, _Supervisor

# A child that exits 0 on SIGTERM (a core or a front end that drains), and one that keeps the
# default SIGTERM action (a front end still starting).
# Each says "ready" once it has set what it does on SIGTERM.
DRAINS = (
    "import signal, sys; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
    "print('ready', flush=True); signal.pause()"
)
STARTING = "import time; print('ready', flush=True); time.sleep(60)"


def _child(code: str) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def _ended(code: str, sig: int = signal.SIGTERM) -> subprocess.Popen[bytes]:
    child = _child(code)
    child.send_signal(sig)
    child.wait(10)
    return child


def _failed() -> subprocess.Popen[bytes]:
    """A front end that failed on its own (exit 1), no signal sent."""
    child = _child("import sys; print('ready', flush=True); sys.exit(1)")
    child.wait(10)
    return child


@pytest.fixture
def supervisor() -> Iterator[_Supervisor]:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    plan = Plan("127.0.0.1", 0, 2, 5.0, "info", "text", "glibc")  # type: ignore[arg-type]
    try:
        yield _Supervisor(plan)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(
    ("front_ends", "verdict"),
    [
        ((0, 0), 0),
        ((0, -signal.SIGTERM), 0),  # the second was still starting when the drain began
        ((0, 1), 1),
        ((0, -signal.SIGKILL), 1),
    ],
)
def test_a_drain_is_clean_only_when_every_front_end_drained_or_had_not_started(
    supervisor: _Supervisor, front_ends: tuple[int, ...], verdict: int
) -> None:
    exits = {
        0: lambda: _ended(DRAINS),
        1: lambda: _failed(),
        -signal.SIGTERM: lambda: _ended(STARTING),
        -signal.SIGKILL: lambda: _ended(STARTING, signal.SIGKILL),
    }
    supervisor.front_ends = [exits[code]() for code in front_ends]
    assert [p.returncode for p in supervisor.front_ends] == list(front_ends)
    supervisor.core = _child(DRAINS)  # stopped by the drain, exits 0
    assert supervisor._drained() == verdict
    assert supervisor.core.returncode == 0


def test_a_core_that_does_not_stop_cleanly_fails_the_drain(supervisor: _Supervisor) -> None:
    supervisor.front_ends = [_ended(DRAINS), _ended(DRAINS)]
    supervisor.core = _child(STARTING)  # ended by the SIGTERM's default action: -15
    assert supervisor._drained() == 1
