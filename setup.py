"""Builds the optional CPU kernels next to the package.

Everything else about the distribution is in pyproject.toml. Three extensions:

- ``runtime.kernels._kernels``: runtime/kernels/*.c as a plain shared library loaded with
  ctypes (runtime/kernels/bridge.py: prefill attention, gated activations, small GEMM).
- ``runtime.kernels._mlx_ext``: the quantized products as MLX primitives
  (runtime/kernels/ext, CMake against the headers, libmlx and CMake package of the
  pinned MLX, and nanobind; runtime/kernels/primitives.py is its bridge).
- ``runtime._blas_shim``: runtime/blas_shim.c, the BLAS names MLX imports forwarded to
  pip's OpenBLAS (runtime/backend.py loads it; on other platforms it forwards nothing).

All are optional: a machine without a compiler, CMake or MLX's development files still
installs, and the server says at start which kernels it runs without. setuptools'
``optional=True`` covers the first and the third; the second is built by `_CMakeBuild`, which warns
instead of failing (mlx.extension's CMakeBuild would abort the whole install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# No -march=native: the kernels pick AVX2+FMA code at run time, so a built wheel runs on
# any CPU of its platform. -Wno-psabi: its vector helpers are always inlined.
_FLAGS = (
    []
    if sys.platform == "win32"
    else ["-O3", "-pthread", "-ffp-contract=fast", "-fvisibility=hidden", "-Wno-psabi"]
)
_ROOT = Path(__file__).resolve().parent


class _CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: str) -> None:
        super().__init__(name, sources=[])
        self.source_dir = str(_ROOT / source_dir)


class _CMakeBuild(build_ext):
    """build_ext that builds CMake extensions too, and lets them fail with a warning."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, _CMakeExtension):
            super().build_extension(ext)
            return
        try:
            self._cmake(ext)
        except Exception as exc:  # any failure: install without it, loudly
            print(
                f"WARNING: the MLX extension {ext.name} was not built ({exc}); the server "
                "runs quantized models on the CPU without it (slowly, dequantized). "
                "Needs a C++17 compiler, CMake >= 3.25 and the pinned mlx/nanobind.",
                file=sys.stderr,
            )

    def _cmake(self, ext: _CMakeExtension) -> None:
        if sys.platform != "linux":
            raise RuntimeError("built on Linux only: Metal and CUDA run MLX's own kernels")
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("no cmake on PATH")
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(tempfile.mkdtemp(prefix="mlxgw-ext-"))
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={build_dir / 'out'}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        env = dict(os.environ)
        # the build environment's site-packages (mlx, nanobind) for the interpreter CMake runs
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [sysconfig.get_path("purelib"), *sys.path, env.get("PYTHONPATH", "")] if p
        )
        subprocess.run(
            [cmake, "-S", ext.source_dir, "-B", str(build_dir), *args], check=True, env=env
        )
        jobs = str(os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True, env=env)
        built = sorted((build_dir / "out").glob("_mlx_ext*"))
        if not built:
            raise RuntimeError("CMake produced no _mlx_ext library")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)
        shutil.rmtree(build_dir, ignore_errors=True)


setup(
    ext_modules=[
        Extension(
            "runtime.kernels._kernels",
            sources=["runtime/kernels/kernels.c", "runtime/kernels/pool.c"],
            depends=["runtime/kernels/common.h", "runtime/kernels/kernels.h"],
            extra_compile_args=_FLAGS,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        ),
        _CMakeExtension("runtime.kernels._mlx_ext", "runtime/kernels/ext"),
        # the names libmlx imports, forwarded to pip's scipy-openblas32 (runtime/backend.py;
        # only Linux's MLX wheel links the reference BLAS)
        *(
            [
                Extension(
                    "runtime._blas_shim",
                    sources=["runtime/blas_shim.c"],
                    extra_compile_args=_FLAGS,
                    optional=True,
                )
            ]
            if sys.platform == "linux"
            else []
        ),
    ],
    cmdclass={"build_ext": _CMakeBuild},
)
