"""Several models in one engine core: one engine per model, each on its own socket, taking turns
on the device.

The starvation bound: model A (a causal embedder, 16 tokens a step) is flooded with long
prompts, then one short request goes to model B (an encoder); B's request must finish after
at most one of A's steps, the one in flight when it arrived. Outputs of two models served
together equal each one served alone; a model that fails to load fails the start, naming it,
with nothing left running; each model's device-memory share is checked after it loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from poolserve.config.core import CoreConfig, Placement
from poolserve.engine.host import GIB, CoreThread, LocalCore, build_engine, check_memory_fraction
from poolserve.engine.loop import Engine
from poolserve.engine.runner import PreparedStep, StepResult
from poolserve.frontend.client import EngineClient
from poolserve.types.errors import ModelStartError
from poolserve.types.observer import NullObserver
from poolserve.types.params import PoolingParams
from poolserve.types.process import socket_path
from poolserve.types.tasks import PoolingTask
from tests.engine.waiting import until

EMBED = PoolingParams(task=PoolingTask.EMBED)
# 12 prompts of 64 tokens at 16 tokens a step: 48 steps of A queued
FLOOD = [[1000 + (7 * i + j) % 4000 for j in range(64)] for i in range(12)]
SHORT = [[2001, 2002, 2003, 2004, 2005]]
PROMPTS_A = [[1000 + 3 * j + i for j in range(n)] for i, n in enumerate([5, 40, 17, 64, 1, 33])]
PROMPTS_B = [[101, *range(2000 + i, 2000 + i + n), 102] for i, n in enumerate([3, 30, 12, 1, 7])]


def _configs(tiny_model_dir: Callable[[str], Path]) -> tuple[CoreConfig, CoreConfig]:
    """A: a causal embedder with a small step budget; B: an encoder embedder."""
    a = CoreConfig.of(
        model=str(tiny_model_dir("llama")),
        max_model_len=64,
        max_num_batched_tokens=16,
        block_size=8,
    )
    b = CoreConfig.of(
        model=str(tiny_model_dir("bert")), max_model_len=32, max_num_batched_tokens=32, block_size=8
    )
    return a, b


# ---- the starvation bound ------------------------------------------------------------------


class _Hold:
    """Holds one forward of an engine on the device (inside its turn) until released."""

    def __init__(self) -> None:
        self.arm = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()
        self.step = -1


def _record(engine: Engine, name: str, log: list[tuple[str, str, int]], hold: _Hold) -> None:
    """Log the start and end of every forward of `engine` (its worker thread, inside its turn);
    the first forward after `hold.arm` waits on the device until `hold.release`."""
    execute = engine.runner.execute

    def recorded(step: PreparedStep) -> StepResult:
        log.append((name, "start", step.step_index))
        if hold.arm.is_set():
            hold.arm.clear()
            hold.step = step.step_index
            hold.holding.set()
            hold.release.wait(30)
        try:
            return execute(step)
        finally:
            log.append((name, "end", step.step_index))

    engine.runner.execute = recorded  # type: ignore[method-assign]


class _Asking:
    """B's seat as the test sees it: notes when B asks for the device, then takes `inner`'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked = threading.Event()

    @contextmanager
    def turn(self) -> Iterator[None]:
        self.asked.set()
        with self.inner.turn():
            yield


class _AfterA:
    """The control's seat for B: it lets A go first, every step A has, before B's."""

    def __init__(self) -> None:
        self.a_idle = threading.Event()

    @contextmanager
    def turn(self) -> Iterator[None]:
        self.a_idle.wait(60)
        yield


class _StepsOfA(NullObserver):
    """B's observer: A's finished steps at the moment B's request finishes."""

    def __init__(self) -> None:
        self.a: Engine | None = None
        self.seen: list[int] = []

    def on_request_done(self, queue_time_s: float, inference_time_s: float) -> None:
        assert self.a is not None
        self.seen.append(self.a.num_steps)


@dataclasses.dataclass
class _Measured:
    counted: int  # A's steps finished between B's submission and B's output
    started: int  # A's forwards started after B asked for the device, before B's forward
    a_steps: int  # A's steps for the whole flood


def _measure(tiny_model_dir: Callable[[str], Path], control: _AfterA | None = None) -> _Measured:
    """Flood A, hold its forward in flight on the device, send B one short request."""

    async def run() -> _Measured:
        b_observer = _StepsOfA()
        core = LocalCore(_configs(tiny_model_dir), [NullObserver(), b_observer])
        await core.start()
        try:
            a, b = core.engines
            b_observer.a = a
            log: list[tuple[str, str, int]] = []
            hold = _Hold()
            _record(a, "A", log, hold)
            _record(b, "B", log, _Hold())
            assert a.turns_seat is not None and b.turns_seat is not None
            turns = a.turns_seat.turns
            assert b.turns_seat.turns is turns  # one device, one line for both models
            seat = _Asking(b.turns_seat if control is None else control)
            b.turns_seat = seat  # type: ignore[assignment]
            flood = a.submit_many(FLOOD, EMBED)
            await _until(lambda: a.num_steps >= 2)
            hold.arm.set()  # A's next forward stays on the device until B has asked for it
            await _until(hold.holding.is_set)
            await _until(lambda: a.num_steps == hold.step)  # every step before it counted
            before = a.num_steps
            (short,) = b.submit_many(SHORT, EMBED)
            # B waits in line for the device (the control: B has asked)
            await _until(seat.asked.is_set if control else lambda: turns.num_waiting == 1)
            hold.release.set()
            if control is not None:
                await asyncio.gather(*flood)
                control.a_idle.set()
            await short
            await asyncio.gather(*flood)
            (after,) = b_observer.seen
            return _Measured(after - before, _started_after_asking(log, hold.step), a.num_steps)
        finally:
            await core.stop()

    return asyncio.run(run())


# steps of a tiny model: poll often, allow for a loaded machine
_until = partial(until, timeout_s=30.0, poll_s=0.001)


def _started_after_asking(log: list[tuple[str, str, int]], held: int) -> int:
    """A's forwards that started after the held one (B was waiting by then) and before B's."""
    b_start = log.index(("B", "start", 0))
    return sum(1 for name, what, i in log[:b_start] if name == "A" and what == "start" and i > held)


def test_a_short_request_waits_for_at_most_the_step_in_flight(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    measured = _measure(tiny_model_dir)
    assert measured.a_steps >= 48  # A had 48 steps queued (768 tokens, 16 a step)
    # not one forward of A started between B asking for the device and B's forward
    assert measured.started == 0
    # counted by finished steps: the step in flight when B arrived, plus at most the step A
    # ran right after B's forward (it may finish before the loop hands B its output)
    assert measured.counted <= 2


def test_control_a_seat_that_lets_a_go_first_shows_the_wait(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    measured = _measure(tiny_model_dir, control=_AfterA())
    # the same measurement, with B's seat letting A run everything first: it can fail (A's
    # every step after the held one ran before B's)
    assert measured.a_steps >= 48
    assert measured.started > 40
    assert measured.counted > 40


# ---- outputs, sockets, start failures ------------------------------------------------------


async def _through(paths: tuple[str, ...], prompts: list[list[list[int]]]) -> list[list[Any]]:
    """Every model's prompts through its socket at once; each model's outputs, in order."""
    clients = [EngineClient(path, timeout_s=30.0) for path in paths]
    for client in clients:
        await client.connect()
    try:
        submitted = [await c.submit_many(p, EMBED) for c, p in zip(clients, prompts, strict=True)]
        outputs = await asyncio.gather(*(asyncio.gather(*futures) for futures in submitted))
        return [[output.data for output in model] for model in outputs]
    finally:
        for client in clients:
            await client.close()


async def _served(configs: list[CoreConfig], prompts: list[list[list[int]]]) -> list[list[Any]]:
    core = LocalCore(configs)
    await core.start()
    try:
        return await _through(core.paths, prompts)
    finally:
        await core.stop()


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Callable[[str], Path]) -> list[list[Any]]:
    """Each model's outputs from a core serving it alone."""
    a, b = _configs(tiny_model_dir)
    return [asyncio.run(_served([a], [PROMPTS_A]))[0], asyncio.run(_served([b], [PROMPTS_B]))[0]]


def _assert_equal(got: list[list[Any]], want: list[list[Any]]) -> None:
    for got_model, want_model in zip(got, want, strict=True):
        for g, w in zip(got_model, want_model, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_two_models_in_one_core_answer_as_each_alone(
    tiny_model_dir: Callable[[str], Path], alone: list[list[Any]]
) -> None:
    configs = list(_configs(tiny_model_dir))
    for _ in range(2):  # concurrent: both models' steps interleave on the device
        _assert_equal(asyncio.run(_served(configs, [PROMPTS_A, PROMPTS_B])), alone)


def test_one_model_alone_takes_no_turns(tiny_model_dir: Callable[[str], Path]) -> None:
    core = CoreThread([_configs(tiny_model_dir)[0]])
    core.start()
    try:
        assert core.engine.turns_seat is None and core.engines == (core.engine,)
    finally:
        core.stop()


def _model_threads() -> set[threading.Thread]:
    return {
        t for t in threading.enumerate() if t.name.startswith(("poolserve-model", "poolserve-core"))
    }


def test_a_model_that_fails_to_load_fails_the_start_naming_it(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing")
    configs = [_configs(tiny_model_dir)[0], CoreConfig.of(model=missing)]
    before = _model_threads()
    local = LocalCore(configs)
    with pytest.raises(ModelStartError, match=f"^model {re.escape(repr(missing))}: no such folder"):
        asyncio.run(local.start())
    assert local.cores == () and not os.path.exists(os.path.dirname(local.paths[0]))
    thread = CoreThread(configs)
    with pytest.raises(ModelStartError, match=f"^model {re.escape(repr(missing))}"):
        thread.start()
    assert not os.path.exists(os.path.dirname(thread.paths[0]))
    assert _model_threads() == before  # the first model's engine never ran; no core thread left


def test_memory_fraction_is_checked_with_the_numbers() -> None:
    check_memory_fraction(GIB, 0.5, 4 * GIB)
    check_memory_fraction(2 * GIB, 0.5, 4 * GIB)  # exactly its share
    with pytest.raises(ValueError) as refused:
        check_memory_fraction(3 * GIB, 0.5, 4 * GIB)
    message = str(refused.value)
    for part in ("holds 3.00 GiB", "gpu_memory_fraction 0.5", "4.00 GiB", "(2.00 GiB)"):
        assert part in message


def test_the_cpu_ignores_the_memory_fraction_with_one_info_line(
    tiny_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(
        _configs(tiny_model_dir)[1], placement=Placement(gpu_memory_fraction=1e-9)
    )
    with caplog.at_level(logging.INFO, logger="poolserve.engine.host"):
        build_engine(config)
    lines = [r for r in caplog.records if "gpu_memory_fraction" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "ignored on cpu" in lines[0].getMessage()


# ---- the engine-core process ---------------------------------------------------------------

CHILD = """
import asyncio, pickle, sys
from poolserve.config.core import CoreConfig
from poolserve.engine.process import serve_core_process
configs = pickle.loads(bytes.fromhex(sys.argv[1]))
sys.exit(asyncio.run(serve_core_process(configs, sys.argv[2])))
"""


@pytest.mark.slow
def test_the_core_process_serves_every_model_on_its_socket(
    tiny_model_dir: Callable[[str], Path], alone: list[list[Any]], tmp_path: Path
) -> None:
    configs = pickle.dumps(list(_configs(tiny_model_dir))).hex()
    directory = str(tmp_path / "cores")
    process = subprocess.Popen([sys.executable, "-c", CHILD, configs, directory])
    try:
        paths = (socket_path(directory, 0), socket_path(directory, 1))
        deadline = time.monotonic() + 120
        while not all(os.path.exists(p) for p in paths):
            assert process.poll() is None, "the core process exited"
            assert time.monotonic() < deadline, "the core process never listened"
            time.sleep(0.05)
        _assert_equal(asyncio.run(_through(paths, [PROMPTS_A, PROMPTS_B])), alone)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_whole_prompt_model_left_to_its_length_is_served_up_to_one_step(
    tiny_model_dir: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """An encoder's prompts run whole: without --max-model-len, its positions beyond the step
    budget are not served (one warning line says so); asked for them, it refuses to start."""
    bert = str(tiny_model_dir("bert"))  # 512 positions
    with caplog.at_level(logging.WARNING, logger="poolserve.engine.host"):
        engine = build_engine(CoreConfig.of(model=bert, max_num_batched_tokens=64))
    assert engine.max_model_len == 64
    (line,) = [r.getMessage() for r in caplog.records if "attends both ways" in r.getMessage()]
    assert "512 positions" in line and "--max-num-batched-tokens 64" in line
    assert build_engine(CoreConfig.of(model=bert)).max_model_len == 512  # they fit a step
    with pytest.raises(ValueError, match="encoder prompts cannot be chunked"):
        build_engine(CoreConfig.of(model=bert, max_num_batched_tokens=64, max_model_len=128))
