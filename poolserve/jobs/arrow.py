"""The Parquet layout of embedded rows, one for `poolserve embed` and the Ray Data integration.

Columns: `id` (the input's id column, its type kept), `embedding` (a fixed-size list per row in
the requested `embed_dtype`) and `prompt_tokens` (int32). Parquet has no bfloat16 or fp8 type:
those are stored as their raw bits (uint16, uint8, little-endian values as vLLM's bytes
encodings send them) and the field's metadata names the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from poolserve.frontend.encoding import to_dtype_bytes
from poolserve.offline.outputs import Pooled

# embed_dtype (vLLM's names) -> Arrow value type of the stored embedding
EMBED_DTYPES: dict[str, pa.DataType] = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),
    "fp8_e4m3": pa.uint8(),
    "fp8_e5m2": pa.uint8(),
}
DTYPE_KEY = b"poolserve.embed_dtype"


def output_schema(id_type: pa.DataType, dim: int, embed_dtype: str) -> pa.Schema:
    """The output's schema for embeddings of `dim` values stored as `embed_dtype`."""
    embedding = pa.field(
        "embedding",
        pa.list_(EMBED_DTYPES[embed_dtype], dim),
        nullable=False,
        metadata={DTYPE_KEY: embed_dtype.encode()},
    )
    return pa.schema(
        [
            pa.field("id", id_type),
            embedding,
            pa.field("prompt_tokens", pa.int32(), nullable=False),
        ]
    )


def embedding_array(vectors: np.ndarray, embed_dtype: str) -> pa.FixedSizeListArray:
    """`[rows, dim]` float32 vectors as a fixed-size list array of the stored type."""
    dim = vectors.shape[1]
    value_type = EMBED_DTYPES[embed_dtype]
    raw = to_dtype_bytes(vectors, embed_dtype, "little")
    values = np.frombuffer(raw, dtype=value_type.to_pandas_dtype())
    return pa.FixedSizeListArray.from_arrays(pa.array(values, type=value_type), dim)


def output_table(ids: pa.Array, pooled: Sequence[Pooled], embed_dtype: str) -> pa.Table:
    """Rows of the output: each id with its input's embedding and prompt token count."""
    vectors = np.stack([p.data for p in pooled]).astype(np.float32, copy=False)
    schema = output_schema(ids.type, vectors.shape[1], embed_dtype)
    tokens = pa.array([p.prompt_tokens for p in pooled], type=pa.int32())
    return pa.Table.from_arrays([ids, embedding_array(vectors, embed_dtype), tokens], schema=schema)
