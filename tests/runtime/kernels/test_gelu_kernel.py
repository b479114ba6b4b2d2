"""The CPU kernels' exact (erf) GELU (runtime/kernels/gelu.py, BERT's MLP activation)
against its MLX form (runtime/models/bert.py) and against math.erf, with the AVX2 code and
the portable code; inputs it does not take fall back to MLX."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest

from runtime.kernels import bridge as cpu_kernels
from runtime.kernels import gelu as gelu_module
from runtime.kernels import primitives
from runtime.kernels.gelu import gelu_erf
from runtime.models.bert import _erf_gelu


@pytest.fixture(params=["native", "generic"])
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(cpu_kernels.ENV_ISA, request.param)
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))
    if cpu_kernels.kernels() is None:
        reason = "the CPU kernels are not built (pip install -e . builds them)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    yield str(request.param)


@pytest.mark.parametrize("path", ["primitive", "ctypes"])
@pytest.mark.parametrize("shape", [(32, 40), (3, 333, 1536)])  # a tail of 7; several threads
def test_gelu_erf_matches_mlx_and_erf(
    shape: tuple[int, ...], isa: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension's primitive (lazy, in the graph) and the ctypes call (a build without
    the extension) compute the same GELU."""
    if path == "ctypes":
        monkeypatch.setattr(gelu_module, "primitive_gelu", lambda x: None)
    elif primitives.gelu_erf(mx.zeros((64, 8))) is None:
        pytest.fail("the extension's GELU primitive did not run")
    mx.random.seed(30)
    x = mx.random.normal(shape) * 4  # past the clamp at |x / sqrt 2| = 4, and around 0
    got = gelu_erf(x)
    assert got is not None and got.shape == x.shape
    np.testing.assert_allclose(np.array(got), np.array(_erf_gelu(x)), atol=2e-6, rtol=1e-6)
    xs = np.array(x, dtype=np.float64).reshape(-1)
    exact = 0.5 * xs * (1.0 + np.array([math.erf(v / math.sqrt(2.0)) for v in xs]))
    np.testing.assert_allclose(np.array(got).reshape(-1), exact, atol=4e-6, rtol=1e-5)


def test_what_it_does_not_take_falls_back() -> None:
    assert gelu_erf(mx.zeros((8, 64))) is None  # fewer than MIN_ROWS rows
    assert gelu_erf(mx.zeros((64, 64), dtype=mx.float16)) is None
