"""Backend policy: which device MLX computes on, and an optimized BLAS for the CPU.

MLX's Linux CPU wheel links a reference BLAS (a few GFLOP/s). An optimized BLAS
loaded with RTLD_GLOBAL *before* ``import mlx`` takes over its cblas symbols
(about 30x faster matmuls here). MKL comes with the `cpu` extra; on AMD processors a
system OpenBLAS goes first, because MKL does not take its fast code paths there (on an
AMD EPYC with AVX-512, OpenBLAS 0.3.21 ran the matrix products of a 64-token prefill
chunk 1.4-2x faster than MKL, and a 2048-token one 1.05-1.25x). This module imports no MLX at import time, so
``configure()`` can run first; call it at process entry (CLI, tests, benchmarks).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

ENV_BLAS = "MLX_GATEWAY_BLAS"  # a path to a BLAS library, or "none" to skip the preload


@dataclass(frozen=True)
class BlasChoice:
    path: str | None
    source: str  # "env", "pip:mkl", "system:openblas", "system:mkl", "none", "not-needed"


_chosen: BlasChoice | None = None


def _pip_candidates() -> list[tuple[str, str]]:
    """Libraries a plain `pip install` provides (the `cpu` extra installs mkl)."""
    out: list[tuple[str, str]] = []
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*"))):
            out.append((path, "pip:mkl"))
    return out


def _system_openblas() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for pattern in (
        "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so*",
        "/usr/lib/*-linux-gnu/libopenblas.so*",
        "/usr/lib64/libopenblas.so*",
        "/usr/local/lib/libopenblas.so*",
    ):
        out.extend((p, "system:openblas") for p in sorted(glob.glob(pattern)))
    found = ctypes.util.find_library("openblas")
    if found:
        out.append((found, "system:openblas"))
    return out


def _system_mkl() -> list[tuple[str, str]]:
    found = ctypes.util.find_library("mkl_rt")
    return [(found, "system:mkl")] if found else []


def cpu_vendor() -> str:
    """The processor's vendor id as Linux reports it ("GenuineIntel", "AuthenticAMD"), or
    "" where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _candidates(amd: bool) -> list[tuple[str, str]]:
    """Every BLAS found, best first for this processor."""
    openblas, mkl = _system_openblas(), _pip_candidates() + _system_mkl()
    return openblas + mkl if amd else mkl + openblas


def _needs_blas() -> bool:
    # Metal (macOS) and CUDA builds do their matmuls on the accelerator; only
    # the Linux CPU wheel ships the reference BLAS.
    return sys.platform.startswith("linux")


def configure_blas() -> BlasChoice:
    """Load the best BLAS available with RTLD_GLOBAL; idempotent."""
    global _chosen
    if _chosen is not None:
        return _chosen
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before the BLAS preload; CPU matmuls may be slow")
    env = os.environ.get(ENV_BLAS)
    if env and env.lower() == "none":
        _chosen = BlasChoice(None, "none")
        return _chosen
    if not _needs_blas():
        _chosen = BlasChoice(None, "not-needed")
        return _chosen
    amd = cpu_vendor() == "AuthenticAMD"
    candidates = [(env, "env")] if env else []
    candidates += _candidates(amd)
    for path, source in candidates:
        try:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            log.debug("cannot load BLAS %s: %s", path, exc)
            continue
        _chosen = BlasChoice(path, source)
        log.info("BLAS: %s (%s)", path, source)
        if source.endswith("mkl") and amd:
            log.info(
                "MKL is slower than OpenBLAS on AMD processors: apt-get install "
                "libopenblas0-pthread and it is chosen instead"
            )
        return _chosen
    log.warning(
        "No optimized BLAS found: MLX's CPU matmuls will be about 30x slower. "
        "Fix: pip install 'mlx-gateway[cpu]' (brings mkl) or apt-get install "
        "libopenblas0-pthread, or set %s to a BLAS library path.",
        ENV_BLAS,
    )
    _chosen = BlasChoice(None, "none")
    return _chosen


def blas_choice() -> BlasChoice | None:
    return _chosen


def configure() -> BlasChoice:
    """Process-entry setup: BLAS first, then MLX may be imported; large buffers mapped."""
    map_large_buffers()
    return configure_blas()


# glibc's mallopt parameters; the size from which buffers are mapped on their own, and the
# most malloc arenas (one per thread that allocates, by default up to 8 per core)
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 1 << 20
ARENA_MAX = 2


def map_large_buffers() -> None:
    """Have glibc map every buffer of 1 MB or more on its own, so that freeing one gives
    its memory back. MLX's CPU allocator takes its buffers from malloc; glibc raises its
    mmap threshold as large blocks are freed (up to 32 MB), after which a prefill's
    temporaries stay in the heap: Qwen2.5-0.5B's GGUF held 0.81 GB resident after a
    512-token prompt, 0.72 GB with this (0.54 GB of weights). MLX's own buffer cache still
    reuses buffers between steps, so a decode step maps nothing new.

    And at most two malloc arenas: every thread that allocates gets an arena of its own,
    whose freed memory it keeps; the kernels' worker threads (started per call when two
    models' engines call at once) grew the one-minute soak's resident memory by 30-58%
    (tests/gateway/test_soak_short.py; with two arenas it passes)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl)
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(_M_ARENA_MAX, ARENA_MAX)


def on_cpu() -> bool:
    """True when MLX's default device is the CPU (call after configure())."""
    import mlx.core as mx  # lazy: MLX must not load before configure() (module docstring)

    return bool(mx.default_device() == mx.cpu)


def default_dtype_name() -> str:
    """Float32 on CPU (bf16/fp16 matmuls have no fast path there), bfloat16 elsewhere."""
    return "float32" if on_cpu() else "bfloat16"


def release_thread_streams() -> None:
    """Wait for, then destroy, the MLX streams the calling thread created.

    Call it last in every thread that ran MLX work. MLX 0.32 leaves a thread's streams
    to the process's exit otherwise, where they can abort it ("terminate called without
    an active exception", exit 134) after all the work is done."""
    import mlx.core as mx  # lazy: MLX must not load before configure() (module docstring)

    for step in (mx.synchronize, getattr(mx, "clear_streams", None)):
        if step is None:
            continue
        try:
            step()
        except Exception as exc:  # a thread ending on an error still ends
            log.debug("releasing this thread's MLX streams: %s", exc)


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere
    nothing). Loading a quantized model frees several hundred MB of transient buffers in
    pieces below glibc's mmap threshold, which stay resident otherwise (Qwen2.5-0.5B's
    GGUF: 1.04 GB resident after load, 0.63 GB after the trim, for 0.54 GB of weights)."""
    if not sys.platform.startswith("linux"):
        return  # macOS's allocator returns large blocks itself; Metal buffers are not malloc's
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl)
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
