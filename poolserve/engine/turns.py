"""Turns on one device for the engines of one core: a saturated model cannot starve another.

Each engine holds a `Seat` and runs its forward inside `seat.turn()`, in its model worker
thread; one turn runs at a time. The rule: when a turn ends, the seat that just stepped goes
behind every seat already waiting (its next ask waits until each of them has had a turn), and
among the waiting the lower priority, then the earliest request, goes first. So a short
request of one model waits for at most one step of each other model (the one in progress
included), whatever their queues; priorities order the waiting, never starve a model. On CUDA
the engines launch on the same default stream, whose kernels run in launch order, so ordering
the launches orders the device's work.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Ask:
    """One seat's request for a turn."""

    priority: int
    arrival: int
    # the asks (by arrival) that were waiting when this seat's last turn ended: they go first
    after: frozenset[int]
    granted: threading.Event = field(default_factory=threading.Event)


class DeviceTurns:
    """The device's turns, shared by every engine of a core (one `seat` each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._waiting: list[_Ask] = []  # a few: one per engine at most
        self._holder: _Ask | None = None  # None only while nobody waits

    def seat(self, priority: int = 0) -> Seat:
        """A seat for one engine; among waiting seats the lower priority goes first."""
        return Seat(self, priority)

    @property
    def num_waiting(self) -> int:
        """Turns asked for and not yet begun (introspection, tests)."""
        with self._lock:
            return len(self._waiting)

    def _acquire(self, seat: Seat) -> _Ask:
        with self._lock:
            ask = _Ask(seat.priority, next(self._arrivals), seat.owed)
            if self._holder is None:
                self._holder = ask
                return ask
            self._waiting.append(ask)
        try:
            ask.granted.wait()
        except BaseException:
            self._abandon(seat, ask)
            raise
        return ask

    def _release(self, seat: Seat, ask: _Ask) -> None:
        """End a turn: the seat owes a turn to every ask waiting now; the best one that owes
        nothing to a waiting ask holds the device next, else nobody."""
        with self._lock:
            assert self._holder is ask, "a turn ended that was not running"
            waiting = frozenset(w.arrival for w in self._waiting)
            seat.owed = waiting
            free = [w for w in self._waiting if not w.after & waiting]
            self._holder = min(free, key=lambda w: (w.priority, w.arrival), default=None)
            if self._holder is not None:
                self._waiting.remove(self._holder)
                self._holder.granted.set()

    def _abandon(self, seat: Seat, ask: _Ask) -> None:
        """A waiter interrupted: pass on a turn granted meanwhile, else stop waiting."""
        with self._lock:
            if self._holder is not ask:
                self._waiting.remove(ask)
                return
        self._release(seat, ask)


class Seat:
    """One engine's place at the device: `with seat.turn(): forward()`."""

    def __init__(self, turns: DeviceTurns, priority: int) -> None:
        self.turns = turns
        self.priority = priority
        self.owed: frozenset[int] = frozenset()  # set by the turns, under their lock

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for the device, hold it for the block, pass it on (also when the block raises)."""
        ask = self.turns._acquire(self)
        try:
            yield
        finally:
            self.turns._release(self, ask)
