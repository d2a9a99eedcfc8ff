"""Plays the engine around the pure planner for tests: plan, allocate, advance, free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from poolserve.engine.sched.kv_blocks import BlockAllocator
from poolserve.engine.sched.planner import BatchPlan, PlannerSeq, ScheduledChunk, plan_step
from poolserve.types.limits import SchedulerConfig


@dataclass(frozen=True)
class Arrival:
    """A prompt that joins the waiting queue before step `at_step` is planned."""

    request_id: int
    num_prompt_tokens: int
    priority: int = 0
    at_step: int = 0


@dataclass
class LiveRequest:
    """The harness's own record of one unfinished request."""

    arrival: Arrival
    arrival_index: int
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)

    def view(self) -> PlannerSeq:
        return PlannerSeq(
            self.arrival.request_id,
            self.arrival.num_prompt_tokens,
            self.num_computed_tokens,
            len(self.block_ids),
            self.arrival.priority,
            self.arrival_index,
        )


class Harness:
    """Plays the engine: plans, allocates the plan's blocks, advances, frees on the last chunk."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.allocator = BlockAllocator(config.num_kv_blocks)
        self.waiting: list[LiveRequest] = []
        self.running: list[LiveRequest] = []
        self.finished: dict[int, LiveRequest] = {}
        self.num_arrived = 0

    def arrive(self, arrival: Arrival) -> None:
        self.waiting.append(LiveRequest(arrival, self.num_arrived))
        self.num_arrived += 1

    def step(self) -> BatchPlan:
        plan = plan_step(
            [r.view() for r in self.waiting],
            [r.view() for r in self.running],
            self.config,
            self.allocator.num_free,
        )
        by_id = {r.arrival.request_id: r for r in self.waiting + self.running}
        for chunk in plan.chunks:
            live = by_id[chunk.request_id]
            assert chunk.start == live.num_computed_tokens
            live.block_ids += self.allocator.allocate(chunk.num_new_blocks)
            live.spans.append((chunk.start, chunk.end))
            live.num_computed_tokens += chunk.num_tokens
            if live in self.waiting:
                self.waiting.remove(live)
                self.running.append(live)
            if chunk.is_last:
                self.running.remove(live)
                self.allocator.free(live.block_ids)
                self.finished[chunk.request_id] = live
        return plan


def run_steps(
    arrivals: Sequence[Arrival], config: SchedulerConfig
) -> list[tuple[ScheduledChunk, ...]]:
    """Every step's chunks until all prompts finish."""
    harness = Harness(config)
    steps: list[tuple[ScheduledChunk, ...]] = []
    while len(harness.finished) < len(arrivals):
        for arrival in arrivals:
            if arrival.at_step == len(steps):
                harness.arrive(arrival)
        steps.append(harness.step().chunks)
        assert len(steps) < 100
    return steps
