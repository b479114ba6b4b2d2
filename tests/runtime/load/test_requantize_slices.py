"""Re-quantizing a GGUF tensor a slice of rows at a time (runtime/load/gguf/decode.py
`requantized`, which keeps a 7B head's float32 temporaries off the load's peak) gives the
triplets of re-quantizing it whole."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.load.affine import affine_quantize
from runtime.load.gguf import decode


@pytest.mark.parametrize("shape", [(37, 64), (3, 11, 96)])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_slices_give_the_whole_tensors_triplets(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], bits: int
) -> None:
    values = np.random.default_rng(bits).standard_normal(shape).astype(np.float32)
    monkeypatch.setattr(decode, "REQUANTIZE_VALUES", 5 * shape[-1])  # 5 rows a slice
    got = decode.requantized(values, 32, bits, mx.float16)
    want = affine_quantize(mx.array(values), group_size=32, bits=bits, scales_dtype=mx.float16)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert mx.array_equal(a, b).item()
