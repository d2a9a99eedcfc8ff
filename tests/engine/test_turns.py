"""`DeviceTurns` with real threads: one turn at a time; when a turn ends, the best seat already
waiting goes next (lower priority, then earlier request), so the seat that just stepped goes
behind every waiting one; a turn that raises still passes the device on.

Threads are lined up deterministically: each next thread starts only once the one before it
is seen waiting (`num_waiting`), so every order asserted here is the rule's, not the OS's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from unittest import mock

import pytest

from poolserve.engine.turns import DeviceTurns, Seat


def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


class _Holder:
    """A thread holding a turn of `seat` until released (then, optionally, asking again)."""

    def __init__(self, seat: Seat, order: list[str], name: str, again: bool = False) -> None:
        self.release = threading.Event()
        self.holding = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(seat, order, name, again))
        self.thread.start()
        assert self.holding.wait(10)

    def _run(self, seat: Seat, order: list[str], name: str, again: bool) -> None:
        with seat.turn():
            self.holding.set()
            self.release.wait()
        if again:  # the engine's next step: it asks right after its turn ended
            with seat.turn():
                order.append(name)


def _queue(turns: DeviceTurns, seat: Seat, order: list[str], name: str) -> threading.Thread:
    """Start a thread that takes one turn of `seat`; return once it is waiting."""
    before = turns.num_waiting

    def run() -> None:
        with seat.turn():
            order.append(name)

    thread = threading.Thread(target=run)
    thread.start()
    _until(lambda: turns.num_waiting == before + 1)
    return thread


def _lineup(priorities: list[tuple[str, int]]) -> list[str]:
    """Hold the device, queue the seats in the given order, release: the order of their turns."""
    turns, order = DeviceTurns(), []
    holder = _Holder(turns.seat(), order, "holder")
    threads = [_queue(turns, turns.seat(p), order, name) for name, p in priorities]
    holder.release.set()
    for thread in [holder.thread, *threads]:
        thread.join(10)
    return order


def test_a_free_device_is_taken_at_once_and_turns_nest_nowhere() -> None:
    turns = DeviceTurns()
    seat = turns.seat()
    for _ in range(3):
        with seat.turn():
            assert turns.num_waiting == 0


def test_equal_priorities_go_in_the_order_they_asked() -> None:
    assert _lineup([("a", 0), ("b", 0), ("c", 0), ("d", 0)]) == ["a", "b", "c", "d"]


def test_lower_priority_goes_first_then_the_earlier_request() -> None:
    lined = [("late", 5), ("b", 0), ("first", -3), ("c", 0), ("last", 9)]
    assert _lineup(lined) == ["first", "b", "c", "late", "last"]


def test_the_seat_that_just_stepped_goes_behind_every_waiting_seat() -> None:
    turns, order = DeviceTurns(), []
    # the stepping seat has the best priority: it still waits behind what already waited
    stepping = _Holder(turns.seat(-100), order, "stepper", again=True)
    queued = [_queue(turns, turns.seat(p), order, name) for name, p in [("x", 3), ("y", 1)]]
    stepping.release.set()
    for thread in [stepping.thread, *queued]:
        thread.join(10)
    assert order == ["y", "x", "stepper"]


def test_lower_priorities_never_starve_a_waiting_seat() -> None:
    turns, order = DeviceTurns(), []
    stepping = _Holder(turns.seat(-1), order, "a", again=True)
    queued = [_queue(turns, turns.seat(p), order, name) for name, p in [("c", -1), ("b", 0)]]
    stepping.release.set()
    for thread in [stepping.thread, *queued]:
        thread.join(10)
    # priority alone would run c, then a again, then b: a owes b its turn
    assert order == ["c", "b", "a"]


def test_saturated_seats_never_overlap_and_all_finish() -> None:
    turns = DeviceTurns()
    taken: list[str] = []
    inside = threading.Lock()
    start = threading.Barrier(3)

    def engine(name: str, priority: int) -> None:
        seat = turns.seat(priority)
        start.wait()
        for _ in range(100):
            with seat.turn():
                assert inside.acquire(blocking=False), "two turns at once"
                taken.append(name)
                inside.release()

    threads = [threading.Thread(target=engine, args=a) for a in [("a", -1), ("b", 0), ("c", 1)]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(taken) == ["a"] * 100 + ["b"] * 100 + ["c"] * 100
    assert turns.num_waiting == 0


def test_a_turn_that_raises_passes_the_device_on() -> None:
    turns, order = DeviceTurns(), []
    seat = turns.seat()
    holding, release = threading.Event(), threading.Event()

    def failing() -> None:
        with pytest.raises(RuntimeError), seat.turn():
            holding.set()
            release.wait()
            raise RuntimeError("the forward failed")

    failer = threading.Thread(target=failing)
    failer.start()
    assert holding.wait(10)
    waiter = _queue(turns, turns.seat(), order, "next")
    release.set()
    for thread in (failer, waiter):
        thread.join(10)
    assert order == ["next"]
    with pytest.raises(ValueError), seat.turn():  # nobody waiting: the device is free again
        raise ValueError("again")
    with seat.turn():
        assert turns.num_waiting == 0


def test_a_waiter_interrupted_leaves_the_line() -> None:
    turns = DeviceTurns()
    holder, other = turns.seat(), turns.seat()
    with holder.turn():
        with (
            mock.patch.object(threading.Event, "wait", side_effect=KeyboardInterrupt),
            pytest.raises(KeyboardInterrupt),
            other.turn(),
        ):
            pass  # never reached: the wait was interrupted
        assert turns.num_waiting == 0
    with other.turn():  # the device was not handed to the interrupted waiter
        pass


def test_a_waiter_interrupted_after_its_turn_came_passes_it_on() -> None:
    turns = DeviceTurns()
    holder, other = turns.seat(), turns.seat()
    held = holder.turn()
    held.__enter__()

    def granted_then_interrupted(timeout: float | None = None) -> bool:
        held.__exit__(None, None, None)  # the holder's turn ends: the waiter is granted it
        raise KeyboardInterrupt

    with (
        mock.patch.object(threading.Event, "wait", side_effect=granted_then_interrupted),
        pytest.raises(KeyboardInterrupt),
        other.turn(),
    ):
        pass
    with holder.turn():  # the turn granted to the interrupted waiter was passed on: free
        assert turns.num_waiting == 0
