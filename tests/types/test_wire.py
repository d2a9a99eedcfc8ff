"""Framing on the socket (poolserve/types/wire.py): `MessageStream` sends length-prefixed
headers and raw buffers, and cuts whole messages out of whatever pieces the bytes arrive in.

The sending side writes through a stand-in transport that records each `writelines` call; the
receiving side is fed bytes directly (`data_received`), as the event loop would feed it, and
once over a real socket pair.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from poolserve.types.wire import MAX_BUFFER_BYTES, MAX_HEADER_BYTES, PREFIX, MessageStream

Message = tuple[bytes, list[bytes]]


class RecordingTransport:
    """What MessageStream uses of a transport; keeps each write's bytes as they were then."""

    def __init__(self) -> None:
        self.writes: list[list[bytes]] = []
        self.closing = False
        self.closed_after: int | None = None  # how many writes came before close()

    def is_closing(self) -> bool:
        return self.closing

    def writelines(self, parts: Sequence[Any]) -> None:
        self.writes.append([memoryview(p).tobytes() for p in parts])

    def close(self) -> None:
        self.closing = True
        self.closed_after = len(self.writes)


class Receiver:
    """A receiving MessageStream and what it handed over."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.views: list[tuple[memoryview, list[memoryview]]] = []
        self.lost: list[Exception | None] = []
        self.stream = MessageStream(self._on_message, self._on_lost)

    def _on_message(
        self, stream: MessageStream, header: memoryview, buffers: list[memoryview]
    ) -> None:
        assert stream is self.stream
        self.views.append((header, buffers))
        self.messages.append((bytes(header), [bytes(b) for b in buffers]))

    def _on_lost(self, stream: MessageStream, exc: Exception | None) -> None:
        assert stream is self.stream
        self.lost.append(exc)

    def feed(self, *chunks: bytes) -> None:
        for chunk in chunks:
            self.stream.data_received(chunk)


def _sent(messages: Sequence[tuple[bytes, Sequence[Any]]]) -> list[list[bytes]]:
    """The writes a MessageStream makes for `messages`, all sent in one turn of the loop."""

    async def send() -> list[list[bytes]]:
        transport = RecordingTransport()
        stream = MessageStream(_never, _never)
        stream.connection_made(transport)  # type: ignore[arg-type]
        for header, buffers in messages:
            stream.send(header, buffers)
        assert transport.writes == []  # nothing leaves before the turn ends
        await asyncio.sleep(0)
        return transport.writes

    return asyncio.run(send())


def _wire(messages: Sequence[tuple[bytes, Sequence[Any]]]) -> bytes:
    """The bytes on the wire for `messages`."""
    (write,) = _sent(messages)
    return b"".join(write)


def _never(*args: object) -> None:
    raise AssertionError(f"not expected here: {args}")


def _as_bytes(buffers: Sequence[Any]) -> list[bytes]:
    return [memoryview(b).tobytes() for b in buffers]


def _documented(header: bytes, buffers: Sequence[bytes]) -> bytes:
    """The layout wire.py documents, written out independently of it."""
    sizes = struct.pack(f"<{len(buffers)}Q", *(len(b) for b in buffers))
    return struct.pack("<IH", len(header), len(buffers)) + sizes + header + b"".join(buffers)


MESSAGES: dict[str, tuple[bytes, list[Any]]] = {
    "header only": (b"\x91\xa5hello", []),
    "one token frame": (b"\x96\xa6submit", [np.arange(5, dtype=np.int64).data]),
    "an empty buffer": (b"h", [b""]),
    "outputs of several dtypes": (
        b"\x95\xa7results",
        [
            np.linspace(-1, 1, 384, dtype=np.float32).data,
            np.arange(12, dtype=np.float16).reshape(3, 4).data,
            np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16).view(np.uint16).data,
            bytearray(b"\x00\xff" * 7),
            b"",
            memoryview(b"raw bytes"),
        ],
    ),
    "an empty header": (b"", [b"x"]),
}


@pytest.mark.parametrize(("header", "buffers"), MESSAGES.values(), ids=MESSAGES.keys())
def test_the_bytes_on_the_wire_are_the_documented_layout(header: bytes, buffers: list[Any]) -> None:
    assert PREFIX.size == 6
    assert _wire([(header, buffers)]) == _documented(header, _as_bytes(buffers))


@pytest.mark.parametrize(("header", "buffers"), MESSAGES.values(), ids=MESSAGES.keys())
def test_a_message_arrives_byte_exact(header: bytes, buffers: list[Any]) -> None:
    receiver = Receiver()
    receiver.feed(_wire([(header, buffers)]))
    assert receiver.messages == [(header, _as_bytes(buffers))]


def test_arrays_keep_their_values_dtype_and_shape_when_read_back() -> None:
    arrays = [
        np.arange(7 * 16, dtype=np.float32).reshape(7, 16) / 7,
        np.array([[1.5, -2.25], [3.0, 0.0]], dtype=ml_dtypes.bfloat16),
        np.array([2**62, -1], dtype=np.int64),
    ]
    receiver = Receiver()
    # bfloat16 exports no buffer of its own: its bits go as uint16
    receiver.feed(_wire([(b"h", [a.view(f"u{a.itemsize}").data for a in arrays])]))
    ((_, buffers),) = receiver.views
    for want, got in zip(arrays, buffers, strict=True):
        read = np.frombuffer(got, dtype=want.dtype).reshape(want.shape)
        np.testing.assert_array_equal(read, want)
        assert read.tobytes() == want.tobytes()


def test_messages_sent_in_one_loop_turn_leave_in_one_write() -> None:
    messages = [(b"first", [b"a"]), (b"second", []), (b"third", [b"b", b"cc"])]
    writes = _sent(messages)
    assert len(writes) == 1
    assert b"".join(writes[0]) == b"".join(_documented(h, b) for h, b in messages)


def test_each_loop_turn_writes_what_it_queued() -> None:
    async def send() -> list[list[bytes]]:
        transport = RecordingTransport()
        stream = MessageStream(_never, _never)
        stream.connection_made(transport)  # type: ignore[arg-type]
        stream.send(b"one")
        await asyncio.sleep(0)
        stream.send(b"two")
        stream.send(b"three")
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # nothing queued: no empty write
        return transport.writes

    writes = asyncio.run(send())
    assert [b"".join(w) for w in writes] == [
        _documented(b"one", []),
        _documented(b"two", []) + _documented(b"three", []),
    ]


def test_close_writes_what_is_queued_first() -> None:
    async def send() -> RecordingTransport:
        transport = RecordingTransport()
        stream = MessageStream(_never, _never)
        stream.connection_made(transport)  # type: ignore[arg-type]
        stream.send(b"last words", [b"!"])
        stream.close()
        await asyncio.sleep(0)  # the flush scheduled by send finds nothing left to write
        return transport

    transport = asyncio.run(send())
    assert [b"".join(w) for w in transport.writes] == [_documented(b"last words", [b"!"])]
    assert transport.closed_after == 1


def test_nothing_is_written_once_the_connection_is_gone() -> None:
    async def send() -> tuple[RecordingTransport, list[Exception | None]]:
        lost: list[Exception | None] = []
        transport = RecordingTransport()
        stream = MessageStream(_never, lambda _, exc: lost.append(exc))
        stream.send(b"before the connection")  # no transport yet
        stream.connection_made(transport)  # type: ignore[arg-type]
        transport.closing = True
        stream.send(b"while closing")
        transport.closing = False
        stream.connection_lost(None)
        stream.send(b"after")
        stream.close()
        await asyncio.sleep(0)
        return transport, lost

    transport, lost = asyncio.run(send())
    assert transport.writes == []
    assert lost == [None]


# ---- cutting messages out of the stream --------------------------------------------------------

ONE = _wire([MESSAGES["outputs of several dtypes"]])
ONE_MESSAGE = (
    MESSAGES["outputs of several dtypes"][0],
    _as_bytes(MESSAGES["outputs of several dtypes"][1]),
)


def test_a_message_split_at_every_byte_boundary_arrives_whole() -> None:
    for cut in range(len(ONE) + 1):
        receiver = Receiver()
        receiver.feed(ONE[:cut])
        assert receiver.messages == ([ONE_MESSAGE] if cut == len(ONE) else []), cut
        receiver.feed(ONE[cut:])
        assert receiver.messages == [ONE_MESSAGE], cut


def test_a_message_fed_one_byte_at_a_time_arrives_once_at_its_last_byte() -> None:
    receiver = Receiver()
    for i in range(len(ONE) - 1):
        receiver.feed(ONE[i : i + 1])
    assert receiver.messages == []
    receiver.feed(ONE[-1:])
    assert receiver.messages == [ONE_MESSAGE]


def test_several_messages_in_one_chunk_arrive_in_order() -> None:
    messages = [(f"header {i}".encode(), [bytes([i]) * i] * (i % 3)) for i in range(5)]
    receiver = Receiver()
    receiver.feed(b"".join(_documented(h, b) for h, b in messages))
    assert receiver.messages == messages


def test_a_chunk_ending_inside_a_message_delivers_the_whole_ones_before_it() -> None:
    first, second, third = (_documented(f"m{i}".encode(), [b"x" * 10 * i]) for i in range(3))
    receiver = Receiver()
    receiver.feed(first + second[:7])
    assert [h for h, _ in receiver.messages] == [b"m0"]
    receiver.feed(second[7:] + third[:-1])
    assert [h for h, _ in receiver.messages] == [b"m0", b"m1"]
    receiver.feed(third[-1:])
    assert [h for h, _ in receiver.messages] == [b"m0", b"m1", b"m2"]


def test_a_long_stream_cut_at_random_points_arrives_whole() -> None:
    rng = random.Random(7)
    messages = [
        (
            rng.randbytes(rng.randrange(0, 40)),
            [rng.randbytes(rng.randrange(0, 300))] * rng.randrange(4),
        )
        for _ in range(200)
    ]
    data = _wire(messages)
    cuts = sorted(rng.sample(range(1, len(data)), 500))
    receiver = Receiver()
    receiver.feed(*(data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)))
    assert receiver.messages == [(h, list(b)) for h, b in messages]


def test_what_was_handed_over_outlives_the_stream_buffer_and_is_writable() -> None:
    """The header and buffers are copies: later reads (which compact the stream's buffer) leave
    them intact, and the engine may write to the token arrays it gets."""
    first = _documented(b"first", [b"\x01" * 16, b"\x02" * 8])
    second = _documented(b"second", [b"\x03" * 24])
    receiver = Receiver()
    receiver.feed(first + second[:5])
    receiver.feed(second[5:] + first[:3])
    receiver.feed(first[3:])
    (header, buffers), *_ = receiver.views
    assert bytes(header) == b"first"
    assert [bytes(b) for b in buffers] == [b"\x01" * 16, b"\x02" * 8]
    assert not buffers[0].readonly
    ids = np.frombuffer(buffers[0], dtype=np.int64)
    ids[0] = 5
    assert bytes(buffers[0][:8]) == (5).to_bytes(8, "little")
    _, again = receiver.views[2]  # the same bytes in a later message: its own copy
    assert [bytes(b) for b in again] == [b"\x01" * 16, b"\x02" * 8]


# ---- bad input ---------------------------------------------------------------------------------


def test_an_oversized_header_length_is_refused_as_soon_as_the_prefix_arrives() -> None:
    receiver = Receiver()
    with pytest.raises(ValueError, match="corrupted stream"):
        receiver.feed(PREFIX.pack(MAX_HEADER_BYTES + 1, 0))
    assert receiver.messages == []


def test_the_largest_header_length_is_waited_for() -> None:
    receiver = Receiver()
    receiver.feed(PREFIX.pack(MAX_HEADER_BYTES, 0) + b"\x00" * 1000)
    assert receiver.messages == []


def test_a_garbled_buffer_size_is_refused_instead_of_waited_for() -> None:
    receiver = Receiver()
    sizes = struct.pack("<2Q", 4, MAX_BUFFER_BYTES + 1)
    with pytest.raises(ValueError, match="corrupted stream: a buffer of"):
        receiver.feed(PREFIX.pack(2, 2) + sizes + b"hd" + b"data")
    assert receiver.messages == []


def test_whole_messages_before_a_corrupted_prefix_are_delivered_first() -> None:
    good = _documented(b"good", [b"data"])
    receiver = Receiver()
    with pytest.raises(ValueError, match="corrupted stream"):
        receiver.feed(good + good + b"\xff\xff\xff\xff\x00\x00")
    assert receiver.messages == [(b"good", [b"data"])] * 2


def test_a_truncated_message_is_never_handed_over() -> None:
    """A peer that goes away mid-message: the part that came is held, never delivered, and the
    owner hears of the lost connection."""
    for data in (ONE[:3], ONE[: PREFIX.size], ONE[:-1]):
        receiver = Receiver()
        receiver.feed(data)
        receiver.stream.connection_lost(None)
        assert receiver.messages == []
        assert receiver.lost == [None]


# ---- over a real socket ------------------------------------------------------------------------


def test_over_a_socket_pair_large_buffers_arrive_whole_and_in_order() -> None:
    big = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32)  # 2 MiB
    messages = [(b"big", [big.data, b"tail"]), (b"small", []), (b"big again", [big.data])]

    async def exchange() -> list[Message]:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        received: list[Message] = []
        done = loop.create_future()

        def on_message(
            stream: MessageStream, header: memoryview, buffers: list[memoryview]
        ) -> None:
            received.append((bytes(header), [bytes(b) for b in buffers]))
            if len(received) == len(messages):
                done.set_result(None)

        _, sender = await loop.create_unix_connection(
            lambda: MessageStream(_never, _ignore), sock=left
        )
        _, receiver = await loop.create_unix_connection(
            lambda: MessageStream(on_message, _ignore), sock=right
        )
        for header, buffers in messages:
            sender.send(header, buffers)
        await asyncio.wait_for(done, 30)
        sender.close()
        receiver.close()
        return received

    received = asyncio.run(exchange())
    assert received == [(h, _as_bytes(b)) for h, b in messages]


def test_over_a_socket_a_corrupted_stream_closes_the_connection_with_the_error() -> None:
    async def exchange() -> list[Exception | None]:
        loop = asyncio.get_running_loop()
        left, right = socket.socketpair()
        lost: list[Exception | None] = []
        gone = loop.create_future()

        def on_lost(stream: MessageStream, exc: Exception | None) -> None:
            lost.append(exc)
            gone.set_result(None)

        loop.set_exception_handler(lambda loop, context: None)  # the loop logs the fatal error
        await loop.create_unix_connection(lambda: MessageStream(_never, on_lost), sock=right)
        left.sendall(PREFIX.pack(MAX_HEADER_BYTES + 1, 0))
        await asyncio.wait_for(gone, 30)
        left.close()
        return lost

    (exc,) = asyncio.run(exchange())
    assert isinstance(exc, ValueError)
    assert "corrupted stream" in str(exc)


def _ignore(*args: object) -> None:
    """A callback whose calls this test does not look at."""
