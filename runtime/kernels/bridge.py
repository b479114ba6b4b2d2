"""Prefill kernels for MLX's CPU backend: attention and gated activations in C.

MLX's CPU `exp` is scalar (about 45M floats/s on one core), so on the CPU the softmax of
a long prompt's attention and the MLP's activation cost more than the matmuls around them.
`runtime/kernels/kernels.c`, compiled by `pip install` into a plain shared library, does
the same maths with a vectorised exp and several threads: attention as blocked
attention with an online softmax (causal or unmasked, grouped KV heads; also over a
quantized KV cache's 8- or 4-bit groups, `quantized_attention`), and the gated
MLP's ``act(gate) * up`` for silu and tanh-gelu. The quantized products (quantized.c,
qdot.c) are MLX primitives instead (primitives.py): ctypes would break a decode step's
lazy graph at every layer (Qwen2.5-0.5B at 4 bits, one stream, the same float kernel
behind both: 105 ms a step through the primitive, 121-155 ms through ctypes).

The bridge evaluates its inputs (`mx.eval`), hands the kernels zero-copy numpy views of
MLX's CPU buffers, runs them with the GIL released (ctypes does) and wraps the result
in a new array. It therefore must not run under `mx.compile` or a transform; the
model code calls it only on the CPU, only for prefill-sized inputs (decode steps keep
MLX's lazy graph, except over a quantized KV cache, where MLX's ops are slower still:
runtime/models/quantized_attention.py), and falls back to MLX (the caller's path) by
returning None.

Environment: ``MLX_GATEWAY_CPU_ATTENTION=0`` forces MLX's own ops for all of these
kernels (tests, comparisons); ``MLX_GATEWAY_CPU_THREADS`` sets the thread count (default:
the CPUs this process may run on); ``MLX_GATEWAY_CPU_ISA=generic`` runs the portable
code on x86 too (tests), and ``avx2`` or ``avxvnni`` run the kernels of a CPU with AVX2
but no AVX-512, without or with AVX-VNNI (tests and benchmarks on a bigger CPU).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

ENV_SWITCH = "MLX_GATEWAY_CPU_ATTENTION"
ENV_THREADS = "MLX_GATEWAY_CPU_THREADS"
# "generic": the portable code even where AVX2 exists; "avx2": AVX2 code even where the
# quantized products' AVX-512 code (qdot512.c, which reads the variable itself) would run
ENV_ISA = "MLX_GATEWAY_CPU_ISA"
# what MLX_GATEWAY_CPU_ISA may name (unset: the best this CPU has)
ISAS = ("generic", "avx2", "avxvnni")
# Fewer rows than this (decode steps, short prompt tails) stay in MLX's lazy graph: the
# kernels would force an evaluation for little gain...
MIN_ROWS = 32
# ...unless there are enough scores (rows x keys) that MLX's scalar exp costs more than
# the evaluation: a short prefill chunk over a long context (interleaved with decode)
MIN_SCORES = 4096
# A linear layer over 1 to 16 rows (a decode step's rows, one per running sequence, and
# a speculative step's verify rows: primitives.SMALL_ROWS) runs in the small-GEMM kernel,
# which computes each row on its own, so a row gets the same bits whatever the step's
# size: speculative decoding's drafts are checked against the logits decoding would have
# had, and a decode step's rows do not depend on how many share it. The BLAS's rows are
# not (MKL's one-row product is a gemv, OpenBLAS's 13-16-row products another kernel,
# each with its own order of sums). What that
# costs with float32 weights (quantized ones take the qdot kernels): the kernel reads each
# weight row once for all rows, where the BLAS packs the weights on every call (Qwen2.5-
# 0.5B's MLP and output projections, 2 threads: 16 rows in about 0.6x MKL's sgemm time,
# one row as fast as MKL's gemv; OpenBLAS at 16 rows 1.3-1.6 ms where the kernel takes 2.2).
GEMM_ROWS = (1, 16)
GEMM_THREAD_FLOATS = 1 << 21  # weights smaller than this (8 MB) take one thread
MAX_HEAD_DIM = 512  # the kernel's scratch bound (kernels.c MAX_DIM)
_LIBRARY_DIR = Path(__file__).resolve().parent
_FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)
# activation name -> kernels.c GATE_* kind
GATED_ACTIVATIONS = MappingProxyType({"silu": 0, "gelu_tanh": 1})


class _AttnArgs(ctypes.Structure):
    """kernels.c AttnArgs."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("q_strides", ctypes.c_int64 * 3),
        ("k_strides", ctypes.c_int64 * 3),
        ("v_strides", ctypes.c_int64 * 3),
        ("o_strides", ctypes.c_int64 * 3),
        ("batch", ctypes.c_int32),
        ("q_heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32),
        ("length", ctypes.c_int32),
        ("keys", ctypes.c_int32),
        ("dim", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("causal", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("generic", ctypes.c_int32),
        ("starts", ctypes.c_void_p),
        ("window", ctypes.c_int32),
    ]


class _QAttnArgs(ctypes.Structure):
    """kernels.c QAttnArgs: attention over a quantized KV cache."""

    _fields_ = [
        ("base", _AttnArgs),
        ("kq", ctypes.c_void_p),
        ("vq", ctypes.c_void_p),
        ("ks", ctypes.c_void_p),
        ("kb", ctypes.c_void_p),
        ("vs", ctypes.c_void_p),
        ("vb", ctypes.c_void_p),
        ("kq_strides", ctypes.c_int64 * 3),
        ("vq_strides", ctypes.c_int64 * 3),
        ("ks_strides", ctypes.c_int64 * 3),
        ("kb_strides", ctypes.c_int64 * 3),
        ("vs_strides", ctypes.c_int64 * 3),
        ("vb_strides", ctypes.c_int64 * 3),
        ("bits", ctypes.c_int32),
        ("group", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class Kernels:
    """The loaded library and the thread count it runs with."""

    lib: ctypes.CDLL
    path: Path
    threads: int
    generic: bool  # the portable code even where the AVX2 one could run
    isa: str


def library_path() -> Path | None:
    """The built library (`runtime/kernels/_kernels*.so`), or None when it was not built."""
    found = sorted(_LIBRARY_DIR.glob("_kernels*.so")) + sorted(_LIBRARY_DIR.glob("_kernels*.dylib"))
    return found[0] if found else None


def env(name: str, default: str = "") -> str:
    """An MLX_GATEWAY_CPU_* variable, stripped and lower-cased.

    The kernels' switches are read on every call (tests change them with
    monkeypatch.setenv), a few hundred times a decode step: `os.environ.get` encodes the
    key each time (about 1.4 us), a lookup in the environment's own bytes mapping, which
    every assignment to os.environ updates, takes a tenth of that."""
    data = getattr(os.environ, "_data", None)
    if isinstance(data, dict):
        raw = data.get(_ENV_KEYS.get(name) or _env_key(name))
        return _decoded(raw) if raw is not None else default
    return os.environ.get(name, default).strip().lower()


_ENV_KEYS: dict[str, bytes] = {}


def _env_key(name: str) -> bytes:
    _ENV_KEYS[name] = key = os.fsencode(name)
    return key


@functools.lru_cache(maxsize=64)
def _decoded(raw: bytes) -> str:
    return os.fsdecode(raw).strip().lower()


@functools.cache
def _cores() -> int:
    """The cores this process may run on (read once: an affinity change while serving is
    not followed)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS has no affinity masks
        return max(1, os.cpu_count() or 1)


def thread_count() -> int:
    value = env(ENV_THREADS)
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            log.warning("%s=%r is not an integer; using the CPU count", ENV_THREADS, value)
    return _cores()


def check_isa() -> bool:
    """Whether MLX_GATEWAY_CPU_ISA is unset or names a set the kernels know; says once per
    load, with the values, when it names another (the kernels then use the best this CPU
    has, as if it were unset)."""
    isa = env(ENV_ISA)
    if not isa or isa in ISAS:
        return True
    log.warning("%s=%r is not one of %s; using the best this CPU has", ENV_ISA, isa,
                ", ".join(ISAS))  # fmt: skip
    return False


def enabled() -> bool:
    """False when the environment forces MLX's own ops."""
    return env(ENV_SWITCH, "1") not in ("0", "false", "no", "off")


@functools.cache
def _load(path: Path | None) -> Kernels | None:
    """Load once per library path; say once, with the fix, why there is none."""
    if path is None:
        log.warning(
            "CPU kernels not built (no %s/_kernels*.so): long prompts prefill several times "
            "slower on the CPU. Fix: reinstall with a C compiler (pip install -e .).",
            _LIBRARY_DIR,
        )
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.mlxgw_attention.argtypes = [ctypes.POINTER(_AttnArgs)]
        lib.mlxgw_attention.restype = ctypes.c_int
        lib.mlxgw_attention_quantized.argtypes = [ctypes.POINTER(_QAttnArgs)]
        lib.mlxgw_attention_quantized.restype = ctypes.c_int
        lib.mlxgw_gated_mul.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.c_int32,
            ctypes.c_int32,
        ]
        lib.mlxgw_gated_mul.restype = ctypes.c_int
        lib.mlxgw_small_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
        lib.mlxgw_small_gemm.argtypes += [ctypes.c_int32] * 2
        lib.mlxgw_small_gemm.restype = ctypes.c_int
        lib.mlxgw_isa.argtypes = [ctypes.c_int32]
        lib.mlxgw_isa.restype = ctypes.c_char_p
    except (OSError, AttributeError) as exc:
        log.warning(
            "cannot load CPU kernels %s (%s): long prompts prefill several times slower on "
            "the CPU. Fix: reinstall (pip install -e .).",
            path,
            exc,
        )
        return None
    check_isa()
    generic = env(ENV_ISA) == "generic"
    kernels = Kernels(lib, path, thread_count(), generic, lib.mlxgw_isa(int(generic)).decode())
    log.info("CPU kernels: %s (%s, %d threads)", path.name, kernels.isa, kernels.threads)
    return kernels


def load() -> Kernels | None:
    """The built library whatever the device and the environment switch, or None."""
    return _load(library_path())


def kernels() -> Kernels | None:
    """The kernels when they should run: on the CPU, enabled, built and loadable."""
    if not enabled() or mx.default_device() != mx.cpu:
        return None
    return load()


def _view(x: mx.array) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A numpy view of an evaluated float32 array (a copy only if its last axis is strided)."""
    out: np.ndarray[Any, np.dtype[np.float32]] = np.asarray(x)
    if out.strides[-1] != out.itemsize:
        out = np.ascontiguousarray(out)
    return out


def _strides(a: np.ndarray[Any, Any], axes: tuple[int, int, int]) -> Any:
    return (ctypes.c_int64 * 3)(*(a.strides[i] // a.itemsize for i in axes))


def attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, causal: bool
) -> mx.array | None:
    """(B, Hq, L, D) queries over (B, Hkv, K, D) keys/values, or None to use MLX instead.

    The queries are the last L of the K positions; `causal` masks each query's future.
    """
    batch, q_heads, length, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if (
        length < 2
        or (length < MIN_ROWS and length * keys < MIN_SCORES)
        or keys < length
        or dim > MAX_HEAD_DIM
        or q_heads % kv_heads
        or v.shape[-1] != dim
        or any(x.dtype not in _FLOAT_TYPES for x in (q, k, v))
    ):
        return None
    lib = kernels()
    if lib is None:
        return None
    dtype = q.dtype
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    mx.eval(q, k, v)
    qn, kn, vn = _view(q), _view(k), _view(v)
    out = np.empty((batch, length, q_heads, dim), dtype=np.float32)
    args = _AttnArgs(
        qn.ctypes.data,
        kn.ctypes.data,
        vn.ctypes.data,
        out.ctypes.data,
        _strides(qn, (0, 1, 2)),
        _strides(kn, (0, 1, 2)),
        _strides(vn, (0, 1, 2)),
        _strides(out, (0, 2, 1)),
        batch,
        q_heads,
        kv_heads,
        length,
        keys,
        dim,
        scale,
        int(causal),
        lib.threads,
        int(lib.generic),
    )
    status = lib.lib.mlxgw_attention(ctypes.byref(args))
    if status != 0:
        log.warning("CPU attention kernel failed (status %d); using MLX's", status)
        return None
    # (B, L, Hq, D) memory seen as (B, Hq, L, D): the caller's transpose back is free
    return mx.array(out).transpose(0, 2, 1, 3).astype(dtype)


# (codes, scales, biases) of keys or values, as `mx.quantize` gives them along head_dim
QuantizedArrays = tuple[mx.array, mx.array, mx.array]
QUANTIZED_KV_BITS = (4, 8)


def quantized_attention(
    q: mx.array,
    keys: QuantizedArrays,
    values: QuantizedArrays,
    *,
    bits: int,
    group_size: int,
    scale: float,
    causal: bool,
    starts: Sequence[int] | None = None,
) -> mx.array | None:
    """(B, Hq, L, D) queries over a quantized cache's (B, Hkv, K, ...) keys and values,
    dequantized a block at a time inside the kernel; None to use MLX instead.

    As `attention`, plus: `starts` gives each batch row's first key (the keys before it,
    a batch row's left padding, are not seen). Any number of rows, one included: the
    caller decides when a decode step comes here (runtime/models/quantized_attention.py).
    """
    batch, q_heads, length, dim = q.shape
    kq, ks, kb = keys
    vq, vs, vb = values
    kv_heads, count = kq.shape[1], kq.shape[2]
    if (
        bits not in QUANTIZED_KV_BITS
        or group_size % 8
        or dim % group_size
        or dim > MAX_HEAD_DIM
        or count < length
        or q_heads % kv_heads
        or kq.shape[-1] * 32 != dim * bits
        or vq.shape[-1] * 32 != dim * bits
        or any(x.shape[-1] * group_size != dim for x in (ks, kb, vs, vb))
        or (starts is not None and len(starts) != batch)
        or q.dtype not in _FLOAT_TYPES
    ):
        return None
    lib = kernels()
    if lib is None:
        return None
    dtype = q.dtype
    q = q.astype(mx.float32)
    groups = [x.astype(mx.float32) for x in (ks, kb, vs, vb)]
    mx.eval(q, kq, vq, *groups)
    qn = _view(q)
    kqn, vqn = _codes(kq), _codes(vq)
    ksn, kbn, vsn, vbn = (_view(x) for x in groups)
    out = np.empty((batch, length, q_heads, dim), dtype=np.float32)
    first = None if starts is None else np.asarray(starts, dtype=np.int32)
    nostrides = (ctypes.c_int64 * 3)(0, 0, 0)
    base = _AttnArgs(
        qn.ctypes.data, None, None, out.ctypes.data,
        _strides(qn, (0, 1, 2)), nostrides, nostrides, _strides(out, (0, 2, 1)),
        batch, q_heads, kv_heads, length, count, dim, scale, int(causal),
        lib.threads, int(lib.generic), None if first is None else first.ctypes.data,
    )  # fmt: skip
    args = _QAttnArgs(
        base, kqn.ctypes.data, vqn.ctypes.data,
        ksn.ctypes.data, kbn.ctypes.data, vsn.ctypes.data, vbn.ctypes.data,
        *(_strides(x, (0, 1, 2)) for x in (kqn, vqn, ksn, kbn, vsn, vbn)),
        bits, group_size,
    )  # fmt: skip
    status = lib.lib.mlxgw_attention_quantized(ctypes.byref(args))
    if status != 0:
        log.warning("CPU quantized attention kernel failed (status %d); using MLX's", status)
        return None
    return mx.array(out).transpose(0, 2, 1, 3).astype(dtype)


def _codes(x: mx.array) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """An evaluated uint32 array of packed codes as bytes (strides in bytes)."""
    words = _view(x)
    out: np.ndarray[Any, np.dtype[np.uint8]] = words.view(np.uint8)
    return out


def gated_mul(gate: mx.array, up: mx.array, activation: str) -> mx.array | None:
    """act(gate) * up for prefill-sized float32 inputs, or None to use MLX instead.

    `activation` is one of GATED_ACTIVATIONS: "silu", or "gelu_tanh" (gelu's tanh form).
    """
    kind = GATED_ACTIVATIONS.get(activation)
    if (
        kind is None
        or gate.shape != up.shape
        or gate.dtype != mx.float32
        or up.dtype != mx.float32
        or gate.ndim == 0
        or gate.size < MIN_ROWS * gate.shape[-1]
    ):
        return None
    lib = kernels()
    if lib is None:
        return None
    mx.eval(gate, up)
    g, u = np.ascontiguousarray(gate), np.ascontiguousarray(up)
    out = np.empty(g.shape, dtype=np.float32)
    status = lib.lib.mlxgw_gated_mul(
        g.ctypes.data, u.ctypes.data, out.ctypes.data, g.size, kind, lib.threads, int(lib.generic)
    )
    if status != 0:
        return None
    return mx.array(out)


def linear(x: mx.array, weight: mx.array) -> mx.array | None:
    """x @ weight.T for a few float32 rows (`gemm_rows`), or None to use MLX instead."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    fewest, most = GEMM_ROWS
    if (
        not fewest <= rows <= most
        or weight.ndim != 2
        or x.dtype != mx.float32
        or weight.dtype != mx.float32
        or weight.shape[1] != x.shape[-1]
    ):
        return None
    lib = kernels()
    if lib is None:
        return None
    mx.eval(x)
    xn = np.ascontiguousarray(x)
    wn = np.asarray(weight)
    if not wn.flags.c_contiguous:
        return None  # a transposed or sliced weight: not worth a copy per call
    out = np.empty((*x.shape[:-1], weight.shape[0]), dtype=np.float32)
    # a small matrix is read faster than a thread starts
    threads = lib.threads if weight.size >= GEMM_THREAD_FLOATS else 1
    status = lib.lib.mlxgw_small_gemm(
        xn.ctypes.data, wn.ctypes.data, out.ctypes.data, rows, weight.shape[0],
        weight.shape[1], threads, int(lib.generic),
    )  # fmt: skip
    return mx.array(out) if status == 0 else None
