"""The kernels' portable C code on another architecture: portable_check.c, built with
Debian's aarch64 cross-compiler and run under qemu-user (.ci/run installs both), and
natively with the same references (where x86 machines run that code only when
MLX_GATEWAY_CPU_ISA=generic asks for it)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
KERNELS = ROOT / "runtime" / "kernels"
SOURCES = [
    Path(__file__).with_name("portable_check.c"),
    *(
        KERNELS / name
        for name in (
            "kernels.c",
            "quantized.c",
            "qdot.c",
            "qdot512.c",
            "qlanes.c",
            "qlanes2.c",
            "pool.c",
            "rows.c",
            "decode_attention.c",
        )
    ),
]


def _build_and_run(compiler: str, runner: list[str], out: Path, extra: list[str]) -> None:
    exe = out / "portable_check"
    subprocess.run(
        [compiler, "-O2", f"-I{KERNELS}", "-o", str(exe), *map(str, SOURCES), "-lm", "-pthread",
         "-Wno-psabi", *extra],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    done = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].endswith(" 0 failed")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs it (apt-get)")
        pytest.skip(f"{name} is not installed")
    return found


def test_portable_code_natively(tmp_path: Path) -> None:
    _build_and_run(_tool("cc"), [], tmp_path, [])


def test_portable_code_on_aarch64(tmp_path: Path) -> None:
    compiler, qemu = _tool("aarch64-linux-gnu-gcc"), _tool("qemu-aarch64")
    _build_and_run(compiler, [qemu], tmp_path, ["-static"])
