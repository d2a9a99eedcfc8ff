"""Checks the vLLM test ports share (tests/http/api/test_vllm_*.py): closeness by cosine, bytes
read back into floats, a checkpoint given a chat template, a tiny ColBERT and its reference."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.tiny_encoders import build_hf_encoder, save_tiny_encoder


@dataclass(frozen=True)
class Served:
    """One served model of the scoring ports and the reference of its scores."""

    client: Any
    name: str
    predict: Callable[[list[list[str]]], list[float]]


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


def save_tiny_colbert(directory: Path, dim: int = 8) -> Path:
    """The tiny BERT saved as Stanford ColBERT saves HF_ColBERT: `bert.*` and a bias-free
    `linear` projection to `dim`."""
    save_tiny_encoder("bert", directory)
    weights = directory / "model.safetensors"
    state = {f"bert.{name}": tensor for name, tensor in load_file(weights).items()}
    hidden = state["bert.embeddings.word_embeddings.weight"].shape[1]
    generator = torch.Generator().manual_seed(3)
    state["linear.weight"] = torch.randn(dim, hidden, generator=generator)
    save_file(state, weights)
    config = json.loads((directory / "config.json").read_text())
    config.update({"architectures": ["HF_ColBERT"], "dim": dim})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


class ColBERTReference:
    """vLLM's ColBERTScoringHfRunner on the tiny checkpoint: transformers' BERT, the projection,
    L2 per token, MaxSim (the sum over query tokens of the best dot product with a document's)."""

    def __init__(self, directory: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self.model = build_hf_encoder("bert")
        self.linear = load_file(directory / "model.safetensors")["linear.weight"]

    def vectors(self, text: str) -> torch.Tensor:
        ids = torch.tensor([self.tokenizer(text)["input_ids"]])
        with torch.inference_mode():
            hidden = self.model(input_ids=ids).last_hidden_state[0]  # [tokens, hidden]
        return torch.nn.functional.normalize(hidden @ self.linear.T, dim=-1)  # [tokens, dim]

    def predict(self, pairs: Sequence[Sequence[str]]) -> list[float]:
        scores = []
        for query, document in pairs:
            similarity = self.vectors(query) @ self.vectors(document).T  # [q, d]
            scores.append(float(similarity.max(dim=1).values.sum()))
        return scores
