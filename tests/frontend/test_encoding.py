"""embed_dtype bytes: the front end's torch-free conversion equals torch's, value for value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from poolserve.frontend.encoding import NARROW_DTYPES, to_dtype_bytes

# embed_dtype -> (torch's dtype, the integer view torch reads its bits through)
TORCH_REFERENCE = {
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}
EDGES = [0.0, -0.0, np.inf, -np.inf, 448, 449, 464, 465, 57344, 57345, 61440, 1e38, -1e38]
EDGES += [2.0**-9, 2.0**-10, 2.0**-17, 2.0**-24, 3e-45, 1.00390625, 1.0078125]


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    scales = (1e-7, 1e-3, 1.0, 30.0, 500.0, 1e5, 1e7)
    random = [rng.standard_normal(20_000).astype(np.float32) * s for s in scales]
    return np.concatenate([*random, np.array(EDGES, dtype=np.float32)])


def test_every_narrow_dtype_has_its_reference() -> None:
    assert set(NARROW_DTYPES) == set(TORCH_REFERENCE)


@pytest.mark.parametrize("endianness", ["little", "big"])
@pytest.mark.parametrize("embed_dtype", sorted(TORCH_REFERENCE))
def test_bytes_equal_torch(embed_dtype: str, endianness: str) -> None:
    values = _values()
    dtype, view = TORCH_REFERENCE[embed_dtype]
    bits = torch.from_numpy(values).to(dtype).view(view).numpy()
    order = "<" if endianness == "little" else ">"
    expected = bits.astype(bits.dtype.newbyteorder(order)).tobytes()
    assert to_dtype_bytes(values, embed_dtype, endianness) == expected
