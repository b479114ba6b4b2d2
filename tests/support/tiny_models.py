"""Tiny random transformers models (the oracle for every architecture) and their MLX twins.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``: this module
imports both at the top.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch
import transformers

from runtime.models import LanguageModel, build_model

HIDDEN = 64
VOCAB = 1024
GEMMA_WINDOW = 8

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


def _llama(**extra: Any) -> Any:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 2, **extra})
    )


def _qwen2(**extra: Any) -> Any:
    return transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**_COMMON, "num_hidden_layers": 2, **extra})
    )


def _qwen3(**extra: Any) -> Any:
    config = {**_COMMON, "num_hidden_layers": 2, "head_dim": 32, **extra}
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config))


def _gemma3_text_config(**extra: Any) -> dict[str, Any]:
    return {
        **_COMMON,
        "num_hidden_layers": 4,
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": GEMMA_WINDOW,
        "sliding_window_pattern": 2,
        **extra,
    }


def _gemma3_text(**extra: Any) -> Any:
    config = transformers.Gemma3TextConfig(**_gemma3_text_config(**extra))
    return transformers.Gemma3ForCausalLM(config)


def _gemma3_multimodal() -> Any:
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    config = transformers.Gemma3Config(
        text_config=_gemma3_text_config(), vision_config=vision, mm_tokens_per_image=4
    )
    return transformers.Gemma3ForConditionalGeneration(config)


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that head_dim 16 has low, medium and high frequency bands
    "original_max_position_embeddings": 64,
}

# name -> (builder, config.json rewrite or None)
Rewrite = Callable[[dict[str, Any]], dict[str, Any]]
Variant = tuple[Callable[[], Any], Rewrite | None]  # builder, config rewrite after saving


def _old_rope_keys(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite transformers-5 `rope_parameters` as the older top-level keys."""
    params = dict(config.pop("rope_parameters"))
    if "full_attention" in params:  # gemma3
        config["rope_theta"] = params["full_attention"].pop("rope_theta")
        config["rope_local_base_freq"] = params["sliding_attention"].pop("rope_theta")
        params = params["full_attention"]
    else:
        config["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        config["rope_scaling"] = params
    return config


VARIANTS: Mapping[str, Variant] = {
    "llama": (lambda: _llama(head_dim=32), None),
    "llama_bias_tied": (
        lambda: _llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        None,
    ),
    "llama3_rope": (
        lambda: _llama(num_key_value_heads=4, rope_parameters=dict(_LLAMA3_ROPE)),
        None,
    ),
    "llama_old_rope_keys": (
        lambda: _llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e4}),
        _old_rope_keys,
    ),
    "qwen2": (_qwen2, None),
    "qwen2_tied": (lambda: _qwen2(tie_word_embeddings=True), None),
    "qwen3": (_qwen3, None),
    "qwen2_yarn": (
        lambda: _qwen2(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10_000.0,
            }
        ),
        None,
    ),
    "gemma3_text": (
        lambda: _gemma3_text(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }
        ),
        None,
    ),
    "gemma3_old_rope_keys": (
        lambda: _gemma3_text(
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 3e3},
            }
        ),
        _old_rope_keys,
    ),
    # transformers' gemma3 applies the final cap and ignores attn_logit_softcapping
    "gemma3_softcap": (
        lambda: _gemma3_text(attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        None,
    ),
    "gemma3_multimodal": (_gemma3_multimodal, None),
}


def randomize(model: Any, seed: int, bias_scale: float | None = None) -> None:
    """Spread the weights so that any wrong formula shows in the logits.

    Default initialisation leaves norms at exactly 1 (or 0 for gemma's 1 + w) and
    biases at 0, which would hide mistakes in them. With `bias_scale`, the routers'
    score-correction bias buffers (DeepSeek-style MoE) get noise of that scale too.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.08)
        if bias_scale is not None:
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(torch.randn(buffer.shape, generator=gen) * bias_scale)


def save_tiny(
    variant: Variant,
    directory: Path,
    seed: int = 0,
    spread: Callable[[Any, int], None] = randomize,
) -> Any:
    """Build a `(builder, config rewrite)` variant with `spread` weights, save it into
    `directory` (config rewritten after saving); return the torch model (eval, eager)."""
    builder, rewrite = variant
    torch.manual_seed(seed)
    model = builder()
    spread(model, seed)
    model.config._attn_implementation = "eager"
    model.eval()
    model.save_pretrained(directory)
    if rewrite is not None:
        path = directory / "config.json"
        path.write_text(json.dumps(rewrite(json.loads(path.read_text())), indent=2))
    return model


def write_tokenizer(folder: Path, vocab: int, config: Mapping[str, str] | None = None) -> None:
    """A word-level tokenizer ("w<i>" is token i), so runtime.load.loader can load the folder;
    `config` is its tokenizer_config.json (default: w1 begins, w2 ends a generation)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    if config is None:
        config = {"eos_token": "w2", "bos_token": "w1"}
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config)))


def make_tiny(name: str, directory: Path, seed: int = 0) -> Any:
    """Build the `name` variant, save it into `directory`; return the torch model (eval)."""
    return save_tiny(VARIANTS[name], directory, seed)


def load_mlx(directory: Path) -> LanguageModel:
    """Our model for a saved HF folder: config, safetensors, sanitize, strict load."""
    config = json.loads((directory / "config.json").read_text())
    model = build_model(config)
    weights: dict[str, mx.array] = {}
    for path in sorted(directory.glob("*.safetensors")):
        loaded = mx.load(str(path))
        assert isinstance(loaded, dict)
        weights.update(loaded)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def torch_logits(model: Any, tokens: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)))
    return np.asarray(out.logits.float().numpy())


def quantize_weight(
    out: dict[str, mx.array], overrides: dict[str, Any], name: str, value: mx.array
) -> None:
    """`name` into `out` as an mlx-lm conversion stores it: 4-bit in groups of 32, a MoE
    router (`mlp.gate`) 8-bit with its per-module override."""
    module = name.removesuffix(".weight")
    bits = 8 if name.endswith("mlp.gate.weight") else 4
    if bits == 8:
        overrides[module] = {"group_size": 32, "bits": 8}
    w, s, b = mx.quantize(value, group_size=32, bits=bits)
    out.update({name: w, f"{module}.scales": s, f"{module}.biases": b})


def save_quantized(
    src: Path, dst: Path, weights: dict[str, mx.array], overrides: dict[str, Any]
) -> None:
    """`weights` (from `quantize_weight`) as an MLX-quantized folder at `dst`, with
    `src`'s config and a `quantization` entry (the caller writes the tokenizer)."""
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, **overrides}
    (dst / "config.json").write_text(json.dumps(config))
