"""A tiny random Qwen3 with the real Qwen3 tokenizer and chat template (thinking and
tools): fast enough to serve the real clients' 10k-30k token requests in seconds, so
every dialect's wire behaviour can be tested on full-size agent prompts. Its output is
noise; tests that need sense use the real models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

CONTEXT = 65536
HIDDEN = 32
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 16
FFN = 64


def _weights(vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": w(vocab, HIDDEN),
        "model.norm.weight": np.ones(HIDDEN, np.float32),
        p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
        p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        p + "self_attn.q_norm.weight": np.ones(HEAD_DIM, np.float32),
        p + "self_attn.k_norm.weight": np.ones(HEAD_DIM, np.float32),
        p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
        p + "mlp.up_proj.weight": w(FFN, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, FFN),
    }


def build_tiny_qwen3(tokenizer_dir: Path, out: Path, *, seed: int = 0) -> Path:
    """Write a HF folder (config, safetensors, tokenizer files) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = [int(v) for v in tok["model"]["vocab"].values()]
    ids += [int(t["id"]) for t in tok.get("added_tokens", ())]
    vocab = max(ids) + 1
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": vocab,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "eos_token_id": 151645,
        "bos_token_id": 151643,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(_weights(vocab, np.random.default_rng(seed)), str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(qwen3_tokenizer_dir, tmp_path_factory.mktemp("tiny-qwen3"))
