"""Messages on a Unix stream socket: each one a length-prefixed header and raw buffers.

A message on the wire: `<IH` (header length, buffer count), one `<Q` length per buffer, the
header (msgpack, see protocol.py), then the buffers. The event loop's own transport does the
I/O (one `writelines` per message, no extra threads or copies on the way out), and a protocol
object cuts whole messages out of what arrives, so a message costs one system call each way.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from typing import Any, cast

PREFIX = struct.Struct("<IH")  # header bytes, buffer count
# A peer is the server's own process; these only catch a corrupted stream early.
MAX_HEADER_BYTES = 64 << 20
MAX_BUFFER_BYTES = 1 << 40  # a garbled 8-byte size is far above it, so it never waits forever

OnMessage = Callable[["MessageStream", memoryview, list[memoryview]], None]
OnLost = Callable[["MessageStream", Exception | None], None]


class MessageStream(asyncio.Protocol):
    """One end of a connection: sends messages, hands each whole received one to `on_message`."""

    def __init__(self, on_message: OnMessage, on_lost: OnLost) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._pending = bytearray()
        self._outgoing: list[Any] = []  # parts queued this loop turn, written in one call

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Keep the transport to write to (uvloop's are not asyncio.Transport subclasses)."""
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        """The peer closed the connection or went away."""
        self.transport = None
        self.on_lost(self, exc)

    def send(self, header: bytes, buffers: Sequence[Any] = ()) -> None:
        """Queue one message (never waits: the peer's reading is bounded by admission).

        Messages sent in one turn of the event loop leave in one write at its end: at high
        concurrency one system call carries many requests (system calls dominate the cost of a
        small message).
        """
        if self.transport is None or self.transport.is_closing():
            return  # the connection is gone; on_lost has told the owner
        sizes = [memoryview(b).nbytes for b in buffers]
        prefix = PREFIX.pack(len(header), len(buffers)) + struct.pack(f"<{len(sizes)}Q", *sizes)
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing += (prefix, header, *buffers)

    def _flush(self) -> None:
        parts, self._outgoing = self._outgoing, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(parts)

    def close(self) -> None:
        """Close the connection (what is queued is written first)."""
        if self.transport is not None:
            if self._outgoing:
                self._flush()
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        """Cut whole messages out of the stream; keep a partial one for the next read."""
        pending = self._pending
        pending += data
        start = 0
        while True:
            message = _cut(pending, start)
            if message is None:
                break
            start, header, buffers = message
            self.on_message(self, header, buffers)
        del pending[:start]


def _cut(data: bytearray, start: int) -> tuple[int, memoryview, list[memoryview]] | None:
    """The message at `start` as (end, header, buffers), or None while it is incomplete."""
    if len(data) - start < PREFIX.size:
        return None
    header_size, count = PREFIX.unpack_from(data, start)
    if header_size > MAX_HEADER_BYTES:
        raise ValueError(f"corrupted stream: header of {header_size} bytes")
    at = start + PREFIX.size
    if len(data) - at < 8 * count:
        return None
    sizes = struct.unpack_from(f"<{count}Q", data, at)
    if any(size > MAX_BUFFER_BYTES for size in sizes):
        raise ValueError(f"corrupted stream: a buffer of {max(sizes)} bytes")
    at += 8 * count
    if len(data) - at < header_size + sum(sizes):
        return None
    # slices of a bytearray are writable copies: the stream buffer is compacted after the loop,
    # outputs outlive it, and the engine takes token arrays as they come
    header = memoryview(data[at : at + header_size])
    at += header_size
    buffers = []
    for size in sizes:
        buffers.append(memoryview(data[at : at + size]))
        at += size
    return at, header, buffers
