"""Quantized embeddings (int8, uint8, binary, ubinary), by sentence-transformers' rules.

`sentence_transformers.quantization.quantize_embeddings`: 8-bit types are each component's
bucket of 256 over a range, floored and clipped; binary types are sign bits packed 8 to a byte,
first bit highest (`binary` shifted into int8 by -128). Its default range is the batch's own
minimum and maximum per dimension, which would make a text's bytes depend on what else is in the
request; here the range is fixed at [-1, 1] over the unit-length vector, where every component
of a normalized embedding lies. The same rule answers Cohere's `embedding_types`, Voyage's
`output_dtype` and Jina's and NIM's `embedding_type`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

UNIT_LOW, UNIT_HIGH = -1.0, 1.0
NUM_LEVELS = 255


def levels(floats: np.ndarray) -> np.ndarray:
    """Each component of the unit-length vector as one of 256 levels over [-1, 1] (last axis)."""
    norms = np.linalg.norm(floats, axis=-1, keepdims=True)
    units = floats / np.where(norms == 0, 1, norms)
    step = np.float32((UNIT_HIGH - UNIT_LOW) / NUM_LEVELS)
    return np.clip(np.floor((units - np.float32(UNIT_LOW)) / step), 0, NUM_LEVELS)


def bits(floats: np.ndarray) -> np.ndarray:
    """One bit per component (1 where it is positive), packed 8 to a byte, first bit highest."""
    return np.packbits(floats > 0, axis=-1)


# precision -> the quantizer of float embeddings (last axis: one embedding)
QUANTIZERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "uint8": lambda floats: levels(floats).astype(np.uint8),
    "int8": lambda floats: (levels(floats) - 128).astype(np.int8),
    "ubinary": bits,
    "binary": lambda floats: (bits(floats).astype(np.int16) - 128).astype(np.int8),
}
PRECISIONS = ("float", *QUANTIZERS)


def quantize(floats: np.ndarray, precision: str) -> np.ndarray:
    """The embedding(s) in `precision`; float is float32, as every route answers floats."""
    if precision == "float":
        return np.ascontiguousarray(floats, dtype=np.float32)
    return QUANTIZERS[precision](np.asarray(floats, dtype=np.float32))
