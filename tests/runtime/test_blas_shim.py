"""pip's OpenBLAS behind runtime/blas_shim.c, for real: in a fresh process (the preload is
process-wide, and this one imported MLX long ago) the backend loads scipy-openblas32 and
the shim, the dynamic linker binds libmlx's BLAS and LAPACK imports to the shim (its own
log, LD_DEBUG=bindings, says so), and MLX's products and factorizations on the CPU come
out right against numpy. Fails on x86-64 and aarch64 Linux when the shim was not built or
the `cpu` extra's OpenBLAS is missing: that is every AMD user's BLAS."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime import backend

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json
from runtime import backend
choice = backend.configure_blas()
import mlx.core as mx
import numpy as np
rng = np.random.default_rng(0)
a = rng.standard_normal((67, 129), dtype=np.float32)
b = rng.standard_normal((129, 45), dtype=np.float32)
m = rng.standard_normal((24, 24), dtype=np.float32)
spd = m @ m.T + 24 * np.eye(24, dtype=np.float32)
with mx.stream(mx.cpu):
    product = mx.matmul(mx.array(a), mx.array(b))
    linear = mx.array(a) @ mx.array(b.T).T
    inverse = mx.linalg.inv(mx.array(spd))
    eigenvalues = mx.linalg.eigvalsh(mx.array(spd))
    mx.eval(product, linear, inverse, eigenvalues)
print(json.dumps({
    "source": choice.source,
    "product": np.array(product).tolist(),
    "linear": np.array(linear).tolist(),
    "inverse": np.array(inverse).tolist(),
    "eigenvalues": np.array(eigenvalues).tolist(),
}))
"""


def _expected() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")


def _bindings(log_dir: Path) -> list[str]:
    """ld.so's binding lines, one per symbol a library resolved (all processes' files)."""
    return [
        line
        for path in log_dir.glob("ld.*")
        for line in path.read_text(errors="replace").splitlines()
        if "binding file" in line
    ]


def _bound_to(lines: list[str], importer: str, symbol: str) -> str:
    """The library `importer`'s `symbol` was bound to, as ld.so logged it ("" if none)."""
    for line in lines:
        if f"`{symbol}'" in line and importer in line.split(" to ")[0]:
            return line.split(" to ", 1)[1].split(" [", 1)[0]
    return ""


def test_mlx_multiplies_and_factors_through_pips_openblas(tmp_path: Path) -> None:
    if not _expected():
        pytest.skip("the shim forwards on x86-64 and aarch64 Linux only")
    assert backend.shim_path() is not None, "runtime/blas_shim.c was not built (pip install -e .)"
    env = dict(
        os.environ,
        MLX_GATEWAY_BLAS=backend.PIP_OPENBLAS,
        LD_DEBUG="bindings",
        LD_DEBUG_OUTPUT=str(tmp_path / "ld"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["source"] == backend.PIP_OPENBLAS, "scipy-openblas32 missing (the cpu extra)"

    lines = _bindings(tmp_path)
    for symbol in ("cblas_sgemm", "sgetrf_", "ssyevd_"):
        assert "_blas_shim" in _bound_to(lines, "libmlx.so", symbol), symbol
        assert "libscipy_openblas" in _bound_to(lines, "_blas_shim", f"scipy_{symbol}"), symbol

    rng = np.random.default_rng(0)
    a = rng.standard_normal((67, 129), dtype=np.float32).astype(np.float64)
    b = rng.standard_normal((129, 45), dtype=np.float32).astype(np.float64)
    m = rng.standard_normal((24, 24), dtype=np.float32)
    spd = (m @ m.T + 24 * np.eye(24, dtype=np.float32)).astype(np.float64)
    scale = np.abs(a) @ np.abs(b)  # the size of the terms each sum adds up
    for key in ("product", "linear"):
        assert np.all(np.abs(np.array(out[key]) - a @ b) <= 1e-5 * scale + 1e-6), key
    np.testing.assert_allclose(np.array(out["inverse"]) @ spd, np.eye(24), atol=1e-4)
    np.testing.assert_allclose(out["eigenvalues"], np.linalg.eigvalsh(spd), rtol=1e-4)
