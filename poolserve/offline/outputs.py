"""What the Python API returns: frozen records holding numpy arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Pooled:
    """One input's pooled output, shaped as its task gives it (see poolserve/types/params.py).

    An embedding is `[dim]`, a reward or classification `[classes]`, a token-level output
    `[tokens, dim]`; float32, as the server's float encoding sends it.
    """

    data: np.ndarray
    prompt_tokens: int  # the prompt's tokens, special tokens included


@dataclass(frozen=True)
class Classification:
    """One input's class probabilities (or raw logits without the activation) and best label."""

    probs: np.ndarray  # [num_classes], float32
    label: str  # the model's id2label name of the best class, else LABEL_<index>
    prompt_tokens: int


@dataclass(frozen=True)
class Ranked:
    """One reranked document: its index in the call's documents and its relevance score."""

    index: int
    score: float
    document: str


@dataclass(frozen=True)
class Reply:
    """An HTTP answer of the in-process server (`AsyncPoolingEngine.request`)."""

    status: int
    headers: dict[str, str]
    body: bytes
