"""The CPU peers benchmark's own arithmetic: its pooling over padded batches and its summaries."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.peers.cpu_runtimes import POOLS, padded
from bench.precision.cpu_peers import Row, _short, table
from tests.tiny_models import minilm_path


def test_pools_skip_the_padding() -> None:
    hidden = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)  # [batch, seq, hidden]
    mask = np.array([[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(POOLS["mean"](hidden, mask), [[1, 2], [8, 9]])
    np.testing.assert_array_equal(POOLS["cls"](hidden, mask), [[0, 1], [6, 7]])
    np.testing.assert_array_equal(POOLS["last"](hidden, mask), [[2, 3], [10, 11]])


def test_padded_batches_give_each_text_its_own_row() -> None:
    # a forward whose hidden state is the token id: each text's mean is its own ids' mean
    def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.repeat(ids[:, :, None].astype(np.float32), 2, axis=2)

    texts = ["a b c", "hello", "a much longer text than the others here"] * 15  # 2 batches
    embed = padded(Path(minilm_path()), forward, "mean")
    got = embed(texts)
    assert got.shape == (len(texts), 2)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(got[0], got[3])  # the same text, wherever its batch put it


def test_the_start_column_and_the_table() -> None:
    said = (
        "--quantization int8 runs onednn: 2.00x float32 on this CPU, AVX512 (X) (ms for one "
        "layer's projections on 256 tokens: onednn 2.94; float32 5.89)"
    )
    assert _short(said) == "onednn, 2.00x float32 at start"
    assert _short("float32 runs torch on this CPU, AVX2 (X) (ms ...: torch 1.00)") == "torch"
    reduced = "--quantization int8 runs fbgemm 7-bit: 1.13x float32 on this CPU, AVX2 (X) (...)"
    assert _short(reduced) == "fbgemm 7-bit, 1.13x float32 at start"
    refused = "--dtype bfloat16 would run at 0.20x float32's speed on this CPU, AVX2 (X): ..."
    assert _short(refused) == "0.20x float32's speed"
    below = (
        "--quantization int8 would run at 1.11x float32's speed on this CPU, AVX2 (X), below the "
        "1.50x it must reach: its fastest kernel (fbgemm 7-bit) takes ..."
    )
    assert _short(below) == "1.11x float32's speed, under 1.50x"
    rows = [Row("poolserve float32", "torch", 2.0, 1.0), Row("peer", "", 1.0, 0.99)]
    lines = table(rows, 1000).splitlines()
    assert lines[2] == "| poolserve float32 | 500 | 1.00x | 1.00000 | torch |"
    assert lines[3] == "| peer | 1,000 | 2.00x | 0.99000 |  |"

    # without poolserve's float32 row, the ratios are to the reference
    alone = [
        Row("poolserve int8", "x86", 1.0, 0.99),
        Row("sentence-transformers (torch)", "", 2.0, 1),
    ]
    lines = table(alone, 1000).splitlines()
    assert lines[0].startswith("| runtime | tokens/s | vs sentence-transformers (torch) |")
    assert lines[2] == "| poolserve int8 | 1,000 | 2.00x | 0.99000 | x86 |"
