"""Builds the optional CPU kernels (runtime/kernels/*.c) next to the package.

Everything else about the distribution is in pyproject.toml. The extension is a plain C
shared library loaded with ctypes (runtime/kernels/bridge.py), not a Python module;
`optional=True` lets an install without a working C compiler succeed, and the runtime
then falls back to MLX's own ops with one warning.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

# No -march=native: the kernels pick AVX2+FMA code at run time, so a built wheel runs on
# any CPU of its platform. -Wno-psabi: its vector helpers are always inlined.
_FLAGS = (
    []
    if sys.platform == "win32"
    else ["-O3", "-pthread", "-ffp-contract=fast", "-fvisibility=hidden", "-Wno-psabi"]
)

setup(
    ext_modules=[
        Extension(
            "runtime.kernels._kernels",
            sources=["runtime/kernels/kernels.c", "runtime/kernels/quantized.c"],
            depends=["runtime/kernels/common.h"],
            extra_compile_args=_FLAGS,
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
            optional=True,
        )
    ]
)
