"""Backend policy: which device MLX computes on, and an optimized BLAS for the CPU.

MLX's Linux CPU wheel links a reference BLAS (a few GFLOP/s). An optimized BLAS
loaded with RTLD_GLOBAL *before* ``import mlx`` takes over its cblas symbols
(about 30x faster matmuls here). The `cpu` extra installs two: MKL (x86-64), first on
Intel, and OpenBLAS (scipy-openblas32), first elsewhere, because MKL does not take its
fast code paths on AMD processors (on an AMD EPYC with AVX-512, OpenBLAS ran the matrix
products of a 64-token prefill chunk 1.4-2x faster than MKL, and a 2048-token one
1.05-1.25x). scipy-openblas32 exports its symbols with a "scipy_" prefix; the shim
runtime/blas_shim.c (built by setup.py) gives them the names libmlx imports. A system
OpenBLAS, where one is installed, goes before pip's (`_candidates` says why); a system
MKL serves where pip's is missing. This module imports no MLX at import time, so
``configure()`` can run first; call it at process entry (CLI, tests, benchmarks).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

# a path to a BLAS library, a source below ("pip:openblas", "system:mkl", ...), or "none"
# to skip the preload
ENV_BLAS = "MLX_GATEWAY_BLAS"
PIP_OPENBLAS = "pip:openblas"
# What an OpenBLAS about to load finds in the environment (it reads it once, at load; a
# value the user set is kept): its idle threads wait 2^4 cycles, not 2^28, before they
# sleep. Since 0.3.27 that wait spins without yielding on x86-64 (pip's OpenBLAS is newer,
# Debian 12's 0.3.21 older), and between two BLAS calls of a prompt chunk our kernels'
# threads want those cores (bench/blas.py, pip's OpenBLAS: prefill 1.1x faster with it on
# an idle machine, 1.35x on a busy one).
OPENBLAS_ENV = {"OPENBLAS_THREAD_TIMEOUT": "4"}
_SHIM_GLOB = "_blas_shim*.so"


@dataclass(frozen=True)
class BlasChoice:
    path: str | None
    # "env", "pip:openblas", "pip:mkl", "system:openblas", "system:mkl", "none", "not-needed"
    source: str


_chosen: BlasChoice | None = None


def _pip_candidates() -> list[tuple[str, str]]:
    """Libraries a plain `pip install` provides (the `cpu` extra installs mkl)."""
    out: list[tuple[str, str]] = []
    for prefix in dict.fromkeys([sys.prefix, sys.base_prefix]):
        for path in sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*"))):
            out.append((path, "pip:mkl"))
    return out


def shim_path() -> str | None:
    """The forwarding library setup.py builds from runtime/blas_shim.c, if it was built."""
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), _SHIM_GLOB)))
    return found[0] if found else None


def pip_openblas() -> list[tuple[str, str]]:
    """scipy-openblas32 (the `cpu` extra), usable only through the shim."""
    if shim_path() is None:
        return []
    try:
        spec = importlib.util.find_spec("scipy_openblas32")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    out: list[tuple[str, str]] = []
    for folder in spec.submodule_search_locations:
        for path in sorted(glob.glob(os.path.join(folder, "lib", "libscipy_openblas*.so"))):
            out.append((path, PIP_OPENBLAS))
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


def _candidates(intel: bool) -> list[tuple[str, str]]:
    """Every BLAS found, best first for this processor. A system OpenBLAS goes before
    pip's: as fast on one thread, but Debian 12's (0.3.21) yields the processor while its
    threads wait and pip's (0.3.27 and later) spins, which costs on a machine busy with
    other work (bench/blas.py, Qwen2.5-0.5B prefill, 2 threads, about one of the 2 cores
    kept busy by others: pip's at 0.65x for 512 tokens, 0.94x for 2048)."""
    openblas, mkl = _system_openblas() + pip_openblas(), _pip_candidates() + _system_mkl()
    return mkl + openblas if intel else openblas + mkl


def _load(path: str, source: str) -> None:
    """Load one candidate with RTLD_GLOBAL (OSError when it cannot serve MLX)."""
    if "openblas" in os.path.basename(path):
        for key, value in OPENBLAS_ENV.items():
            os.environ.setdefault(key, value)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    if source != PIP_OPENBLAS:
        return
    # after the OpenBLAS, whose scipy_ symbols the shim's jumps bind to
    shim = shim_path()
    if shim is None:
        raise OSError("runtime/blas_shim.c was not built")
    if ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL).mlxgw_blas_shim_forwards() != 1:
        raise OSError(f"{shim} forwards nothing on this processor")


def _from_env(env: str, intel: bool) -> list[tuple[str, str]]:
    """MLX_GATEWAY_BLAS's candidates: the library at a path, or a source's libraries."""
    if ":" in env and os.path.sep not in env:
        named = [c for c in _candidates(intel) if c[1] == env]
        if not named:
            log.warning("%s=%s: no such BLAS found; probing the others", ENV_BLAS, env)
        return named
    return [(env, "env")]


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
    intel = cpu_vendor() == "GenuineIntel"
    candidates = _from_env(env, intel) if env else []
    candidates += [c for c in _candidates(intel) if c not in candidates]
    for path, source in candidates:
        try:
            _load(path, source)
        except OSError as exc:
            log.debug("cannot load BLAS %s: %s", path, exc)
            continue
        _chosen = BlasChoice(path, source)
        log.info("BLAS: %s (%s)", path, source)
        if source.endswith("mkl") and not intel:
            log.info(
                "MKL is slower than OpenBLAS on this processor: pip install "
                "'mlx-gateway[cpu]' (brings scipy-openblas32) and it is chosen instead"
            )
        return _chosen
    log.warning(
        "No optimized BLAS found: MLX's CPU matmuls will be about 30x slower. "
        "Fix: pip install 'mlx-gateway[cpu]' (brings scipy-openblas32 and mkl; the "
        "OpenBLAS needs the shim setup.py builds with a C compiler), or set %s to a BLAS "
        "library path.",
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


# glibc's mallopt parameters: the size from which buffers are mapped on their own, how much
# free memory the top of a heap may keep, and the most malloc arenas (one per thread that
# allocates, by default up to 8 per core)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 32 << 20
ARENA_MAX = 2


def map_large_buffers() -> None:
    """Have glibc map every buffer of 4 MB or more on its own, so that freeing one gives
    its memory back. MLX's CPU allocator takes its buffers from malloc; glibc raises its
    mmap threshold as large blocks are freed (up to 32 MB), after which a prefill's
    temporaries stay in the heap: Qwen2.5-0.5B's GGUF held 0.81 GB resident after a
    512-token prompt, 0.72 GB with a fixed threshold (0.54 GB of weights). MLX's own
    buffer cache still reuses buffers between steps, so a decode step maps nothing new.

    Not lower: the buffers of a few MB that an encoder's pieces (MiniLM, 512 tokens: the
    MLP's 3 MB) and a prefill's smaller products come and go in have shapes that change
    from piece to piece, so MLX's cache misses them, and a mapped one is faulted in page by
    page each time. With the threshold at 1 MB, 1,000 MiniLM embeddings took 858,000 page
    faults and 1.6 s of system time (16% of the CPU); at 4 MB, with the heap's top keeping
    up to 32 MB, 2,400 faults and 0.14 s, at the same peak resident size (444 MB).

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
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
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
