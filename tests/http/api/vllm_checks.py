"""Checks the vLLM test ports share (tests/http/api/test_vllm_*.py): closeness by cosine, bytes
read back into floats, and the MiniLM checkpoint given a chat template."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")
BYTE_ORDERS: dict[str, Literal["<", ">"]] = {"little": "<", "big": ">"}
TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# vLLM's tests serve their embedders with this template (--chat-template): each message a line
DUMMY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'] + ': ' + message['content'] + '\\n'}}"
    "{% endfor %}"
)


def check_embeddings_close(first: Sequence[Any], second: Sequence[Any], tol: float = 1e-3) -> None:
    """vLLM's check_embeddings_close: each pair's cosine similarity within `tol` of 1."""
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        cosine = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
        assert cosine >= 1 - tol, cosine


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))


def decode(raw: bytes, dtype: str, endianness: str) -> np.ndarray:
    """Bytes -> float32, read with torch (as vLLM's clients do), not with the server's encoder."""
    torch_dtype = TORCH_DTYPES[dtype]
    width = torch.tensor([], dtype=torch_dtype).element_size()
    order = BYTE_ORDERS[sys.byteorder if endianness == "native" else endianness]
    words = np.frombuffer(raw, dtype=np.dtype(f"u{width}").newbyteorder(order)).astype(f"=u{width}")
    return torch.from_numpy(words.view(np.uint8).copy()).view(torch_dtype).float().numpy()


def with_chat_template(source: Path, directory: Path, template: str) -> Path:
    """`source`'s files linked into `directory`, its tokenizer config given `template` (this
    server reads a checkpoint's template: it has no server-wide --chat-template)."""
    directory.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "tokenizer_config.json":
            (directory / item.name).symlink_to(item)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
