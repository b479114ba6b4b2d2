"""The loader's and the architectures' oracles compare logits to 1e-4: quantized layers
multiply decode rows in float32 here (the float kernel). The default int16 rounding of
decode rows has its own bound (tests/runtime/kernels/test_primitives.py) and its own
real-model check (tests/runtime/load/test_real_models.py, which asks for it)."""

from __future__ import annotations

import pytest

from runtime.kernels.primitives import ENV_ACTIVATIONS


@pytest.fixture(autouse=True)
def _float_rows(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    if "served_rows" not in request.keywords:
        monkeypatch.setenv(ENV_ACTIVATIONS, "float32")
