"""JSON out: answers from numpy buffers (orjson, base64, bytes), encoded on or off the loop."""

from __future__ import annotations

import base64
import sys
from collections.abc import (
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Literal

import ml_dtypes
import numpy as np
import orjson

from poolserve.types.outputs import PoolingOutput

OPTIONS = orjson.OPT_SERIALIZE_NUMPY
JSON = "application/json"
ROWS_PER_PIECE = 256  # rows of a token-level output encoded at once when streaming
# An answer of at most this many output values is encoded on the event loop, not in a thread.
# Measured on 2 cores (docs/benchmarks.md "Per-request CPU: the fast path"): a one-embedding
# answer took ~85 us less CPU per request without the thread hop (executor queue, a thread
# wake-up, the result handed back to the loop), while orjson writes a float32 in ~16 ns and
# base64 in ~4 ns; 16384 values, ~0.25 ms of float JSON, hold the loop no longer than inline
# tokenization may (frontend/texts.py INLINE_CHARS).
INLINE_VALUES = 16384


# embed_dtype -> ml_dtypes' type for those numpy lacks, and the magnitude torch (the reference
# vLLM's clients decode against) saturates to: fp8 e4m3fn has no infinity, so torch clamps to
# its largest finite value where ml_dtypes would give NaN. The bytes equal torch's for every
# non-NaN value (tests/frontend/test_encoding.py).
NARROW_DTYPES: dict[str, tuple[type[np.generic], float | None]] = {
    "bfloat16": (ml_dtypes.bfloat16, None),
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, None),
}
# endianness -> numpy byte order; native is this host's, as vLLM's
BYTE_ORDERS: dict[str, Literal["<", ">"]] = {
    "little": "<",
    "big": ">",
    "native": "<" if sys.byteorder == "little" else ">",
}


def to_dtype_bytes(data: np.ndarray, embed_dtype: str, endianness: str = "little") -> bytes:
    """Bytes of data in the requested dtype and byte order (one-byte dtypes have none)."""
    order = BYTE_ORDERS[endianness]
    if embed_dtype in NARROW_DTYPES:
        dtype, saturate = NARROW_DTYPES[embed_dtype]
        values = np.asarray(data, dtype=np.float32)
        if saturate is not None:
            values = np.clip(values, -saturate, saturate)
        raw = values.astype(dtype)
        bits = raw.view(np.dtype(f"u{raw.dtype.itemsize}"))  # numpy reorders integers only
        return bits.astype(bits.dtype.newbyteorder(order)).tobytes()
    return np.ascontiguousarray(data, dtype=np.dtype(embed_dtype).newbyteorder(order)).tobytes()


def binary_parts(
    outputs: Iterable[np.ndarray], embed_dtype: str, endianness: str
) -> tuple[list[bytes], list[dict[str, object]]]:
    """vLLM's `bytes` format: each output's raw bytes and its metadata item (offsets, shape)."""
    parts: list[bytes] = []
    items: list[dict[str, object]] = []
    offset = 0
    for index, data in enumerate(outputs):
        raw = to_dtype_bytes(data, embed_dtype, endianness)
        items.append(
            {
                "index": index,
                "embed_dtype": embed_dtype,
                "endianness": endianness,
                "start": offset,
                "end": offset + len(raw),
                "shape": list(data.shape),
            }
        )
        parts.append(raw)
        offset += len(raw)
    return parts, items


def dumps(document: object) -> bytes:
    """Serialize a response document (numpy arrays included)."""
    return orjson.dumps(document, option=OPTIONS)


def _open(fields: Mapping[str, object]) -> bytes:
    """`{"a":1,"b":2,` ready for one more key (or `{` when there are no fields)."""
    head = dumps(fields)[:-1]
    return head + b"," if fields else head


def _key(key: str) -> bytes:
    return orjson.dumps(key) + b":"


def encode_item(
    fields: Mapping[str, object],
    key: str,
    data: np.ndarray,
    encoding_format: str,
    embed_dtype: str = "float32",
    endianness: str = "little",
) -> bytes:
    """One output object: its fields plus `key` holding the nested floats or the base64 text.

    Base64 text needs no JSON escaping, so its bytes are spliced in as they are: no str
    round trip and no second pass over a payload that can be tens of megabytes.
    """
    if encoding_format == "base64":
        raw = base64.b64encode(to_dtype_bytes(data, embed_dtype, endianness))
        return b"".join((_open(fields), _key(key), b'"', raw, b'"}'))  # one copy of the payload
    return b"".join((_open(fields), _key(key), dumps(as_numbers(data)), b"}"))


def as_numbers(data: np.ndarray) -> np.ndarray:
    """The output as JSON numbers: quantized integers as they are, anything else float32."""
    return data if data.dtype.kind in "iu" else as_float32(data)


def as_float32(data: np.ndarray) -> np.ndarray:
    """The output as orjson writes float32 lists: contiguous float32 (a view when it already is)."""
    return np.ascontiguousarray(data, dtype=np.float32)


def sparse_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sparse output `[2, nnz]` as its int64 vocabulary ids and float32 weights."""
    # the ids travel as float32 next to the weights: exact, vocabularies stay below 2**24
    return data[0].astype(np.int64), np.ascontiguousarray(data[1], dtype=np.float32)


def document(fields: Mapping[str, object], key: str, items: Iterable[bytes]) -> bytes:
    """A response document: its fields plus `key` holding the already-encoded items."""
    return b"".join((_open(fields), _key(key), b"[", b",".join(items), b"]}"))


def stream_item(
    fields: Mapping[str, object], data: np.ndarray, key: str = "data"
) -> Iterator[bytes]:
    """One NDJSON line of float output, in pieces of ROWS_PER_PIECE rows: never one giant blob."""
    if data.ndim < 2 or data.shape[0] <= ROWS_PER_PIECE:
        yield encode_item(fields, key, data, "float") + b"\n"
        return
    yield _open(fields) + _key(key) + b"["
    for start in range(0, data.shape[0], ROWS_PER_PIECE):
        rows = dumps(np.ascontiguousarray(data[start : start + ROWS_PER_PIECE]))[1:-1]
        yield (b"," if start else b"") + rows
    yield b"]}\n"


@dataclass(frozen=True)
class Encoded:
    """A reply body that is not JSON (vLLM's bytes formats), with headers of its own."""

    body: bytes
    media_type: str
    headers: Mapping[str, str] = field(default_factory=dict)


def timing_headers(outputs: Sequence[PoolingOutput]) -> dict[str, str]:
    """x-queue-time and x-inference-time: the slowest input's, in seconds."""
    if not outputs:
        return {}
    return {
        "x-queue-time": f"{max(o.queue_time_s for o in outputs):.6f}",
        "x-inference-time": f"{max(o.inference_time_s for o in outputs):.6f}",
    }
