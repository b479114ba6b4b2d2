"""GGUF tensors -> HF-named MLX arrays, undoing llama.cpp's conversion transforms.

Names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` and so on
(llama.cpp's standard tensor names). Transforms llama.cpp's converter applied and we
reverse:

- llama architecture: the rows of Q and K are permuted per head from HF's "rotate
  half" order to interleaved pairs (``permute`` in convert_hf_to_gguf.py); reversed by
  :func:`unpermute_rows`. Qwen2/Qwen3/Gemma3 use NEOX rope in llama.cpp: not permuted.
- gemma: every ``*norm.weight`` had 1 added (llama.cpp's RMSNorm multiplies by w, HF's
  gemma norm by 1 + w); 1 is subtracted back.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.gguf import GGUFFile, TensorInfo
from runtime.gguf_quants import (
    GROUP,
    Affine,
    dequantize,
    is_float,
    requantize_bits,
    to_affine,
)

log = logging.getLogger(__name__)

_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Per-block tensors. ffn_norm is the pre-MLP norm: llama/qwen call it
# post_attention_layernorm, gemma (which also has a real post-attention norm)
# pre_feedforward_layernorm.
_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA_BLOCK_NAMES: Mapping[str, str] = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
}

# Tensors that carry no HF parameter (rope_freqs becomes config rope_scaling).
_IGNORED = frozenset({"rope_freqs.weight"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
_PERMUTED_ARCHS = frozenset({"llama"})


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None when it has none we know."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        block, part, kind = match.groups()
        names = _GEMMA_BLOCK_NAMES if arch in _GEMMA_ARCHS else _BLOCK_NAMES
        mapped = names.get(part)
        return None if mapped is None else f"model.layers.{block}.{mapped}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None or kind not in ("weight", "bias") else f"{mapped}.{kind}"


def unpermute_rows(rows: int, n_heads: int) -> np.ndarray:
    """Row index that undoes llama.cpp's Q/K permutation: ``hf = gguf[index]``.

    Per head of ``d`` rows, llama.cpp stores HF row ``t*d/2 + j`` at ``2j + t``.
    """
    head_dim = rows // n_heads
    half = head_dim // 2
    t = np.arange(2).reshape(1, 2, 1)
    j = np.arange(half).reshape(1, 1, half)
    h = np.arange(n_heads).reshape(n_heads, 1, 1)
    return (h * head_dim + 2 * j + t).reshape(-1)


@dataclass(frozen=True)
class _Transform:
    rows: np.ndarray | None = None  # row permutation
    minus_one: bool = False


def _transform(gguf_name: str, arch: str, config: Mapping[str, Any], rows: int) -> _Transform:
    if arch in _PERMUTED_ARCHS:
        if ".attn_q." in gguf_name:
            return _Transform(rows=unpermute_rows(rows, int(config["num_attention_heads"])))
        if ".attn_k." in gguf_name:
            return _Transform(rows=unpermute_rows(rows, int(config["num_key_value_heads"])))
    if arch in _GEMMA_ARCHS and gguf_name.endswith("norm.weight"):
        return _Transform(minus_one=True)
    return _Transform()


@dataclass
class ConvertedWeights:
    """HF-named arrays, and for quantized modules their ``{"bits", "group_size"}``."""

    weights: dict[str, mx.array] = field(default_factory=dict)
    quantization: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def _float_tensor(gf: GGUFFile, info: TensorInfo, tf: _Transform) -> np.ndarray:
    values = dequantize(gf.raw(info.name), info.ggml_type, info.shape)
    if tf.rows is not None:
        values = values[tf.rows]
    if tf.minus_one:
        values = values - np.float32(1.0)
    return values


def _keep_quantized(info: TensorInfo, name: str) -> bool:
    """Only 2-D weights of quantized types stay quantized (Linear and Embedding)."""
    return name.endswith(".weight") and len(info.shape) == 2 and not is_float(info.ggml_type)


@dataclass(frozen=True)
class _Decoded:
    """One tensor decoded in numpy (worker threads); MLX arrays are made on the caller's
    thread, since MLX streams are per thread."""

    name: str
    values: np.ndarray | None = None  # float32
    affine: Affine | None = None
    requantize_bits: int | None = None  # quantize ``values`` to this many bits


def _decode(
    gf: GGUFFile, info: TensorInfo, name: str, config: Mapping[str, Any], keep_quantized: bool
) -> _Decoded:
    tf = _transform(info.name, gf.architecture, config, info.shape[0])
    if keep_quantized and _keep_quantized(info, name):
        affine = to_affine(gf.raw(info.name), info.ggml_type)
        if affine is not None:
            return _Decoded(name, affine=affine if tf.rows is None else affine.take_rows(tf.rows))
        # No exact affine form (Q6_K, Q2_K, IQ*): dequantize, re-quantize finely.
        bits = requantize_bits(info.ggml_type)
        return _Decoded(name, values=_float_tensor(gf, info, tf), requantize_bits=bits)
    return _Decoded(name, values=_float_tensor(gf, info, tf))


def _store(out: ConvertedWeights, item: _Decoded, dtype: mx.Dtype) -> None:
    module = item.name[: -len(".weight")]
    if item.affine is not None:
        a = item.affine
        weight, scales, biases = mx.array(a.weight), mx.array(a.scales), mx.array(a.biases)
        bits, group = a.bits, a.group_size
    elif item.values is not None and item.requantize_bits is not None:
        bits, group = item.requantize_bits, GROUP
        weight, scales, biases = mx.quantize(mx.array(item.values), group_size=group, bits=bits)
    elif item.values is not None:
        array = mx.array(item.values)
        out.weights[item.name] = array if array.dtype == dtype else array.astype(dtype)
        return
    else:
        raise AssertionError(f"nothing decoded for {item.name}")
    out.weights[item.name] = weight
    # scales/biases in the compute dtype: quantized matmuls return the scales' dtype
    out.weights[f"{module}.scales"] = scales.astype(dtype)
    out.weights[f"{module}.biases"] = biases.astype(dtype)
    out.quantization[module] = {"bits": bits, "group_size": group}


def convert_weights(
    gf: GGUFFile,
    config: Mapping[str, Any],
    *,
    dtype: mx.Dtype,
    keep_quantized: bool,
    workers: int | None = None,
) -> ConvertedWeights:
    """Every tensor of ``gf`` under its HF name: float ``dtype`` arrays, or (with
    ``keep_quantized``) MLX affine triplets for the quantized 2-D weights.

    Tensors are decoded on a few threads (numpy releases the GIL; about 1.4x faster on
    2 cores); MLX arrays are made on the calling thread.
    """
    out = ConvertedWeights()
    jobs: list[tuple[TensorInfo, str]] = []
    for info in gf.tensors.values():
        name = hf_name(info.name, gf.architecture)
        if name is not None:
            jobs.append((info, name))
        elif info.name not in _IGNORED:
            out.skipped.append(info.name)
    if out.skipped:
        log.warning("%s: ignoring tensors with no HF name: %s", gf.path, ", ".join(out.skipped))
    # largest first, so the long conversions do not end up last on one thread
    jobs.sort(key=lambda job: -job[0].nbytes)
    count = max(1, workers or min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=count) as pool:
        # a bounded window of decoded tensors keeps peak memory near one model copy
        pending: deque[Future[_Decoded]] = deque()
        for info, name in jobs:
            pending.append(pool.submit(_decode, gf, info, name, config, keep_quantized))
            if len(pending) > count:
                _store(out, pending.popleft().result(), dtype)
        while pending:
            _store(out, pending.popleft().result(), dtype)
    return out
