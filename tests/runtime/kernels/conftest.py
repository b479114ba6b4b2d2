"""What the MLX extension's tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

from runtime import kernels
from runtime.kernels import primitives


@pytest.fixture
def ext(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The loaded extension, on the CPU; its absence fails where it is expected."""
    module = primitives.extension()
    if module is None:
        if primitives.expected():
            pytest.fail("the MLX extension did not load (pip install -e . builds it)")
        pytest.skip("no MLX extension on this platform")
    monkeypatch.delenv(primitives.ENV_ACTIVATIONS, raising=False)
    monkeypatch.delenv(kernels.ENV_ISA, raising=False)
    with mx.stream(mx.cpu):
        yield module
