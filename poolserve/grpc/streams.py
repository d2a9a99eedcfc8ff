"""TEI's streaming RPCs: each request message answered in order, with a bound on the messages in
flight.

A reader takes a slot before it reads the next message, and a slot is given back only once that
message's answer has been written: a client that sends faster than it reads stops being read
(HTTP/2 flow control then holds it back), so a stream never holds more than `limit` requests.
When the call ends early (the client cancels, an answer fails), every request still running is
cancelled, and with it its engine work.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# request messages of one stream in the pipeline at once (read, queued or running, unwritten)
STREAM_IN_FLIGHT = 64
_END = None  # the reader's last entry: no more messages


async def in_order(
    requests: AsyncIterable[Req],
    answer: Callable[[Req], Awaitable[Resp]],
    limit: int = STREAM_IN_FLIGHT,
) -> AsyncIterator[Resp]:
    """Each request's answer in request order, at most `limit` requests in flight."""
    slots = asyncio.Semaphore(limit)
    running: asyncio.Queue[asyncio.Task[Resp] | None] = asyncio.Queue()

    async def read() -> None:
        try:
            async for request in requests:
                await slots.acquire()
                running.put_nowait(asyncio.ensure_future(answer(request)))
        finally:
            running.put_nowait(_END)

    reader = asyncio.ensure_future(read())
    tasks: list[asyncio.Task[Resp]] = []
    try:
        while True:
            task = await running.get()
            if task is None:
                break
            tasks.append(task)
            yield await task
            tasks.pop()
            slots.release()
        await reader  # a failed read raises here
    finally:
        reader.cancel()
        for task in tasks:
            task.cancel()
        while not running.empty():
            queued = running.get_nowait()
            if queued is not None:
                queued.cancel()
