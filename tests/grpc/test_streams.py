"""A stream's messages: answered in order, never more than the bound in flight, and whatever still
runs is cancelled when the call ends early."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from poolserve.grpc.calls import _client
from poolserve.grpc.streams import in_order


async def _messages(count: int, read: list[int]) -> AsyncIterator[int]:
    for index in range(count):
        read.append(index)
        yield index


def test_answers_come_in_order_with_at_most_limit_in_flight() -> None:
    running = 0
    most = 0

    async def answer(index: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(random.random() / 500)  # finish out of order
        running -= 1
        return index * 2

    async def run() -> list[int]:
        read: list[int] = []
        return [reply async for reply in in_order(_messages(200, read), answer, limit=8)]

    assert asyncio.run(run()) == [i * 2 for i in range(200)]
    assert most <= 8


def test_a_reader_that_stops_stops_the_reading_and_cancels_the_rest() -> None:
    cancelled = 0

    async def answer(index: int) -> int:
        nonlocal cancelled
        try:
            await asyncio.sleep(0 if index == 0 else 10)
        except asyncio.CancelledError:
            cancelled += 1
            raise
        return index

    async def run() -> list[int]:
        read: list[int] = []
        replies = in_order(_messages(10_000, read), answer, limit=4)
        first = await anext(replies)
        await asyncio.sleep(0.05)  # the client does not read on
        assert len(read) <= 5  # the bound, and the one answered
        await replies.aclose()  # the call ends
        return [first, len(read)]

    first, _ = asyncio.run(run())
    assert first == 0
    assert cancelled == 3


def test_peers_as_the_access_log_reads_them() -> None:
    assert _client("ipv4:10.0.0.1:5000") == ("10.0.0.1", 5000)
    assert _client("ipv6:[::1]:5000") == ("::1", 5000)
    assert _client("unix:/tmp/socket") == ("unix:/tmp/socket", 0)
