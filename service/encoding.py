"""Response encoding straight from numpy buffers: orjson for floats, base64 for raw bytes."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import orjson
import torch

OPTIONS = orjson.OPT_SERIALIZE_NUMPY
ROWS_PER_PIECE = 256  # rows of a token-level output encoded at once when streaming


def to_dtype_bytes(data: np.ndarray, embed_dtype: str) -> bytes:
    """Little-endian bytes of data in the requested dtype."""
    if embed_dtype == "bfloat16":
        as_bf16 = torch.from_numpy(np.ascontiguousarray(data)).to(torch.bfloat16)
        return as_bf16.view(torch.int16).numpy().astype("<i2").tobytes()
    return np.ascontiguousarray(data, dtype=np.dtype(embed_dtype).newbyteorder("<")).tobytes()


def encode_value(data: np.ndarray, encoding_format: str, embed_dtype: str = "float32") -> object:
    """The JSON value of one output: the array itself (orjson nests it) or a base64 string."""
    if encoding_format == "base64":
        return base64.b64encode(to_dtype_bytes(data, embed_dtype)).decode("ascii")
    return np.ascontiguousarray(data, dtype=np.float32)


def dumps(document: object) -> bytes:
    """Serialize a response document (numpy arrays included)."""
    return orjson.dumps(document, option=OPTIONS)


def stream_item(item: dict[str, object], data: np.ndarray, key: str = "data") -> Iterator[bytes]:
    """One NDJSON line for an output, in pieces of ROWS_PER_PIECE rows: never one giant blob."""
    head = dumps(item)[:-1]  # the item's fields without its closing brace
    separator = b"," if item else b""
    if data.ndim < 2 or data.shape[0] <= ROWS_PER_PIECE:
        yield head + separator + b'"' + key.encode() + b'":' + dumps(data) + b"}\n"
        return
    yield head + separator + b'"' + key.encode() + b'":['
    for start in range(0, data.shape[0], ROWS_PER_PIECE):
        piece = dumps(np.ascontiguousarray(data[start : start + ROWS_PER_PIECE]))[
            1:-1
        ]  # rows w/o brackets
        yield (b"," if start else b"") + piece
    yield b"]}\n"
