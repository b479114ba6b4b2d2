"""GGUF tensors -> HF-named MLX arrays, undoing llama.cpp's conversion transforms.

Names: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` and so on
(llama.cpp's standard tensor names). Transforms llama.cpp's converter applied and we
reverse:

- llama architecture: the rows of Q and K are permuted per head from HF's "rotate
  half" order to interleaved pairs (``permute`` in convert_hf_to_gguf.py); reversed by
  :func:`unpermute_rows`. Qwen2/Qwen3/Gemma3 use NEOX rope in llama.cpp: not permuted.
- gemma: every ``*norm.weight`` had 1 added (llama.cpp's RMSNorm multiplies by w, HF's
  gemma norm by 1 + w); 1 is subtracted back.

Blocks from ``num_hidden_layers`` on (the multi-token-prediction layers GLM files carry)
are not read. The mixture-of-experts names are in runtime/load/gguf/moe_names.py.
"""

from __future__ import annotations

import logging
import os
import re
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from runtime.load.gguf.decode import (
    ConvertedWeights,
    Decoded,
    Plan,
    Transform,
    decode_tensor,
    store,
)
from runtime.load.gguf.moe_names import (
    MOE_BLOCK_NAMES,
    MOE_FULL_NAMES,
    STRICT_ARCHS,
    check_gate_up,
    redundant,
)
from runtime.load.gguf.reader import GGUFFile, TensorInfo

log = logging.getLogger(__name__)

_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Per-block tensors. ffn_norm is the pre-MLP norm: llama/qwen call it
# post_attention_layernorm, gemma (which also has a real post-attention norm)
# pre_feedforward_layernorm.
_DENSE_BLOCK_NAMES: Mapping[str, str] = {
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
_BLOCK_NAMES: Mapping[str, str] = {**_DENSE_BLOCK_NAMES, **MOE_BLOCK_NAMES}
_GEMMA_BLOCK_NAMES: Mapping[str, str] = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
}

# Tensors that carry no HF parameter (rope_freqs becomes config rope_scaling).
_IGNORED = frozenset({"rope_freqs.weight"})
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_BLOCK_INDEX_RE = re.compile(r"^blk\.(\d+)\.")
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
_PERMUTED_ARCHS = frozenset({"llama"})


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The HF parameter name of a GGUF tensor, or None when it has none we know."""
    match = _BLOCK_RE.match(gguf_name)
    if match:
        block, part, kind = match.groups()
        full = MOE_FULL_NAMES.get(f"{part}.{kind}")
        if full is not None:
            return f"model.layers.{block}.{full}"
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


def _transform(gguf_name: str, arch: str, config: Mapping[str, Any], rows: int) -> Transform:
    if arch in _PERMUTED_ARCHS:
        if ".attn_q." in gguf_name:
            return Transform(rows=unpermute_rows(rows, int(config["num_attention_heads"])))
        if ".attn_k." in gguf_name:
            return Transform(rows=unpermute_rows(rows, int(config["num_key_value_heads"])))
    if arch in _GEMMA_ARCHS and gguf_name.endswith("norm.weight"):
        return Transform(minus_one=True)
    return Transform()


def _jobs(gf: GGUFFile, num_layers: int, skipped: list[str]) -> list[tuple[TensorInfo, str]]:
    """(tensor, HF name) of every tensor the model reads; the rest go to ``skipped``
    (blocks past the decoder silently; others with a warning, or for the strict
    architectures an error)."""
    check_gate_up({info.name: info.shape for info in gf.tensors.values()})
    jobs: list[tuple[TensorInfo, str]] = []
    unnamed: list[str] = []
    past = 0
    for info in gf.tensors.values():
        match = _BLOCK_INDEX_RE.match(info.name)
        if match is not None and int(match.group(1)) >= num_layers:
            skipped.append(info.name)
            past += 1
            continue
        name = hf_name(info.name, gf.architecture)
        if name is not None:
            jobs.append((info, name))
        elif info.name not in _IGNORED:
            unnamed.append(info.name)
    if unnamed and gf.architecture in STRICT_ARCHS:
        raise ValueError(
            f"{gf.path}: {gf.architecture} tensors with no HF name (the model would load "
            f"without them): {', '.join(unnamed[:8])}{' ...' if len(unnamed) > 8 else ''}"
        )
    if unnamed:
        log.warning("%s: ignoring tensors with no HF name: %s", gf.path, ", ".join(unnamed))
    if past:
        log.info("%s: not reading %d tensors of blocks past the decoder", gf.path, past)
    skipped.extend(unnamed)
    extra = redundant(name for _, name in jobs)
    skipped.extend(info.name for info, name in jobs if name in extra)
    return [(info, name) for info, name in jobs if name not in extra]


def convert_weights(
    gf: GGUFFile,
    config: Mapping[str, Any],
    plan: Plan,
    *,
    workers: int | None = None,
) -> ConvertedWeights:
    """Every tensor of ``gf`` under its HF name: float arrays in the plan's dtype, or MLX
    affine triplets for the quantized 2-D weights and expert stacks the plan keeps
    quantized and the float weights it quantizes (runtime/load/gguf/decode.py).

    Tensors are decoded on a few threads (numpy releases the GIL; about 1.4x faster on
    2 cores); MLX arrays are made on the calling thread.
    """
    out = ConvertedWeights()
    jobs = _jobs(gf, int(config["num_hidden_layers"]), out.skipped)
    # largest first, so the long conversions do not end up last on one thread
    jobs.sort(key=lambda job: -job[0].nbytes)
    count = max(1, workers or min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=count) as pool:
        # a bounded window of decoded tensors keeps peak memory near one model copy
        pending: deque[tuple[str, Future[Decoded]]] = deque()

        def finish() -> None:
            source, future = pending.popleft()
            store(out, future.result(), plan)
            gf.release(source)  # its pages leave the process's resident memory

        for info, name in jobs:
            tf = _transform(info.name, gf.architecture, config, info.shape[0])
            pending.append((info.name, pool.submit(decode_tensor, gf, info, name, tf, plan)))
            if len(pending) > count:
                finish()
        while pending:
            finish()
    return out
