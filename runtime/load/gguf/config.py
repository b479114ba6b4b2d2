"""A HF-style config.json dict from a GGUF's metadata (llama, qwen2, qwen3, gemma3, and
the mixture-of-experts qwen3moe, glm4moe, deepseek2 through runtime/load/gguf/moe.py).

Keys follow llama.cpp's ``{arch}.*`` hyperparameters; what GGUF leaves implicit is
filled in the way llama.cpp does it (noted where it happens).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from runtime.load.gguf.meta import arch_float, arch_int, require_int
from runtime.load.gguf.moe import MOE_CONFIGS
from runtime.load.gguf.reader import GGUFFile

log = logging.getLogger(__name__)

# GGUF general.architecture -> (HF model_type, HF architectures entry)
_ARCHITECTURES: Mapping[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "glm4moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "deepseek2": ("deepseek_v3", "DeepseekV3ForCausalLM"),
}

# llama.cpp uses every 6th gemma3 layer as global attention when the file does not say.
_GEMMA3_SWA_PERIOD = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA3_27B_LAYERS = 62


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def _rope_scaling(gf: GGUFFile) -> dict[str, Any] | None:
    """``rope.scaling.*`` as a HF rope_scaling dict, or llama3's from its rope_freqs."""
    kind = gf.arch_get("rope.scaling.type")
    factor = arch_float(gf, "rope.scaling.factor")
    if kind in (None, "none") or not factor or factor == 1.0:
        if "rope_freqs.weight" in gf.tensors:
            return _llama3_scaling(gf)
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind), "factor": factor}
    original = arch_int(gf, "rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    if kind == "yarn":
        for gguf_key, hf_key in (
            ("rope.scaling.attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            value = arch_float(gf, gguf_key)
            if value is not None:
                scaling[hf_key] = value
    return scaling


def _llama3_factors(
    theta: float, dims: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """Per-frequency divisors of HF's llama3 rope (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _llama3_scaling(gf: GGUFFile) -> dict[str, Any] | None:
    """llama.cpp writes Llama 3.1+'s rope scaling only as a ``rope_freqs`` tensor of
    divisors. Recover HF's llama3 parameters: the factor is the largest divisor; the
    other three are Meta's published values, accepted only if they reproduce the tensor."""
    freqs = np.asarray(gf.raw("rope_freqs.weight"), dtype=np.float64).reshape(-1)
    theta = arch_float(gf, "rope.freq_base", 10_000.0) or 10_000.0
    dims = 2 * freqs.size
    factor = float(freqs.max())
    if factor <= 1.0:
        return None
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 2048)):
        expect = _llama3_factors(theta, dims, factor, low, high, original)
        if np.allclose(expect, freqs, rtol=1e-3, atol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    log.warning(
        "rope_freqs in %s matches no llama3 rope scaling; ignoring it (long contexts may degrade)",
        gf.path,
    )
    return None


def _gemma3_extras(gf: GGUFFile, config: dict[str, Any]) -> None:
    """Gemma 3 facts llama.cpp hard-codes rather than stores."""
    layers = int(config["num_hidden_layers"])
    pattern = gf.arch_get("attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray) and pattern.size == layers:
        # newer converters: one bool per layer, true = sliding window
        config["layer_types"] = [
            "sliding_attention" if bool(p) else "full_attention" for p in pattern
        ]
    else:
        period = int(pattern) if pattern is not None else _GEMMA3_SWA_PERIOD
        config["sliding_window_pattern"] = period
        config["layer_types"] = [
            "sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)
        ]
    config["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_BASE
    # llama.cpp: 27B scales queries by hidden/heads, the other sizes by head_dim.
    heads = int(config["num_attention_heads"])
    if layers == _GEMMA3_27B_LAYERS:
        config["query_pre_attn_scalar"] = int(config["hidden_size"]) // heads
    else:
        config["query_pre_attn_scalar"] = int(config["head_dim"])
    config["hidden_activation"] = "gelu_pytorch_tanh"
    softcap = arch_float(gf, "final_logit_softcapping")
    config["final_logit_softcapping"] = softcap
    attn_softcap = arch_float(gf, "attn_logit_softcapping")
    if attn_softcap is not None:
        config["attn_logit_softcapping"] = attn_softcap


def _vocab_size(gf: GGUFFile) -> int:
    embed = gf.tensors.get("token_embd.weight")
    if embed is not None:
        return embed.shape[0]
    size = arch_int(gf, "vocab_size")
    if size:
        return size
    return len(gf.get("tokenizer.ggml.tokens") or [])


def hf_config(gf: GGUFFile) -> dict[str, Any]:
    """The config.json a HF checkpoint of this GGUF would have."""
    arch = gf.architecture
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    model_type, hf_arch = _ARCHITECTURES[arch]
    hidden = require_int(gf, "embedding_length")
    heads = require_int(gf, "attention.head_count")
    layers = require_int(gf, "block_count")
    head_dim = arch_int(gf, "attention.key_length") or hidden // heads
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": arch_int(gf, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": arch_int(gf, "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": arch_int(gf, "context_length", 2048),
        "rms_norm_eps": arch_float(gf, "attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": arch_float(gf, "rope.freq_base", 10_000.0),
        "vocab_size": _vocab_size(gf),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
    }
    scaling = _rope_scaling(gf)
    if scaling is not None:
        config["rope_scaling"] = scaling
    window = arch_int(gf, "attention.sliding_window")
    if window:
        config["sliding_window"] = window
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in gf.tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in gf.tensors
    if arch == "gemma3":
        _gemma3_extras(gf, config)
    if arch in MOE_CONFIGS:
        MOE_CONFIGS[arch](gf, config)
    for name in ("bos", "eos", "padding"):
        token_id = gf.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = int(token_id)
    return config
