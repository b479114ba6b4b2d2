"""GGUF files end to end: tiny transformers models written as GGUF the way llama.cpp's
converter does it (names, Q/K permutation, gemma's norm + 1, rope_freqs) must load back
into models whose logits match transformers; and the real GGUF files load with the right
config, tensors equal to transformers' own GGUF conversion, and sensible answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference_dequantize
from mlx.utils import tree_flatten

from runtime.backend import on_cpu
from runtime.load.gguf.names import unpermute_rows
from runtime.load.gguf.reader import GGUFFile
from runtime.load.loaded import LoadedModel
from runtime.load.loader import load
from tests.support.gguf_helpers import (
    LLAMA3,
    TOKENS,
    append_rope_freqs,
    llama_cpp_rope_freqs,
    our_logits,
    randomize,
    torch_logits,
    write_gguf,
)

# -- tiny transformers models written as GGUF (llama.cpp's conversion) ---------------------


def _tiny_llama(llama3_rope: bool) -> Any:
    transformers = pytest.importorskip("transformers")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 500000.0}
    if llama3_rope:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": LLAMA3["factor"],
            "low_freq_factor": LLAMA3["low_freq_factor"],
            "high_freq_factor": LLAMA3["high_freq_factor"],
            "original_max_position_embeddings": LLAMA3["original"],
        }
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
    )
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    randomize(model)
    return model


def _llama_meta(cfg: Any) -> dict[str, Any]:
    return {
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "block_count": cfg.num_hidden_layers,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "rope.freq_base": 500000.0,
        "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }


@pytest.mark.parametrize("llama3_rope", [False, True], ids=["default_rope", "llama3_rope"])
def test_tiny_llama_gguf_matches_transformers(tmp_path: Path, llama3_rope: bool) -> None:
    model = _tiny_llama(llama3_rope)
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama", model, _llama_meta(model.config))
    if llama3_rope:
        # llama.cpp stores llama3 scaling only as this tensor: rewrite with it added
        append_rope_freqs(path, llama_cpp_rope_freqs(500000.0, 16))
    loaded = load(path)
    assert loaded.config["model_type"] == "llama"
    assert loaded.config["tie_word_embeddings"] is False
    if llama3_rope:
        assert loaded.config["rope_scaling"]["rope_type"] == "llama3"
        assert loaded.config["rope_scaling"]["factor"] == pytest.approx(8.0)
    else:
        assert "rope_scaling" not in loaded.config
    np.testing.assert_allclose(
        our_logits(loaded, TOKENS), torch_logits(model, TOKENS), atol=2e-4, rtol=1e-4
    )
    assert loaded.chat_template == "{{ messages }}"
    assert loaded.eos_token_ids == frozenset({511})
    assert (loaded.quantized, loaded.dtype, loaded.context_length) == (False, "float32", 512)


def test_reader_agrees_with_gguf_package(tmp_path: Path) -> None:
    from gguf import GGUFReader

    model = _tiny_llama(llama3_rope=False)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "llama", model, _llama_meta(model.config), quant=QT.Q8_0)
    ours, reference = GGUFFile(path), GGUFReader(str(path))
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = ours.metadata[key]
        if isinstance(got, np.ndarray):
            assert np.array_equal(got, np.asarray(expected)), key
        else:
            assert got == expected, key
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == int(tensor.tensor_type)
        assert np.array_equal(ours.raw(tensor.name), np.asarray(tensor.data)), tensor.name


def _tiny_gemma3() -> Any:
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,  # llama.cpp assumes head_dim (all sizes but 27B)
        num_hidden_layers=4,
        vocab_size=512,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        sliding_window=8,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    model = transformers.Gemma3ForCausalLM(config)
    model.config._attn_implementation = "eager"
    randomize(model, seed=1)
    return model


def test_tiny_gemma3_gguf_matches_transformers(tmp_path: Path) -> None:
    model = _tiny_gemma3()
    cfg = model.config
    meta = {
        **_llama_meta(cfg),
        "rope.freq_base": 1e6,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.sliding_window": 8,
        "attention.sliding_window_pattern": 2,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 2.0,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", model, meta)
    loaded = load(path)
    config = loaded.config
    assert config["model_type"] == "gemma3_text"
    assert config["tie_word_embeddings"] is True
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert (config["head_dim"], config["query_pre_attn_scalar"], config["sliding_window"]) == (
        16,
        16,
        8,
    )
    np.testing.assert_allclose(
        our_logits(loaded, TOKENS), torch_logits(model, TOKENS), atol=2e-4, rtol=1e-4
    )
    params = dict(tree_flatten(loaded.model.parameters()))
    expected = model.state_dict()["model.layers.1.post_feedforward_layernorm.weight"].numpy()
    # llama.cpp stored w + 1; we subtract it again (exact up to float32 rounding)
    got = np.array(params["model.layers.1.post_feedforward_layernorm.weight"])
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("quant", [QT.Q8_0, QT.Q4_0, QT.Q5_1], ids=str)
def test_quantized_gguf_dequantizes_on_cpu_and_stays_quantized_on_request(
    tmp_path: Path, quant: QT
) -> None:
    model = _tiny_llama(llama3_rope=False)
    path = tmp_path / "tiny-q.gguf"
    write_gguf(path, "llama", model, _llama_meta(model.config), quant=quant)
    floats = load(path, keep_quantized=False)
    assert floats.quantized is False
    # the dequantized q_proj equals the reference decoder's, un-permuted
    raw = GGUFFile(path).raw("blk.0.attn_q.weight")
    q_ref = reference_dequantize(np.array(raw), quant)[unpermute_rows(64, 4)]
    params = dict(tree_flatten(floats.model.parameters()))
    assert np.array_equal(np.array(params["model.layers.0.self_attn.q_proj.weight"]), q_ref)
    kept = load(path, keep_quantized=True, dtype="float32")
    assert kept.quantized is True
    kept_params = dict(tree_flatten(kept.model.parameters()))
    assert "model.layers.0.self_attn.q_proj.scales" in kept_params
    np.testing.assert_allclose(
        our_logits(kept, TOKENS), our_logits(floats, TOKENS), atol=1e-3, rtol=1e-3
    )
    # without a dtype, a quantized GGUF computes in float16 on an accelerator (its scales'
    # precision), in float32 on the CPU
    assert load(path, keep_quantized=True).dtype == ("float32" if on_cpu() else "float16")


# -- the real GGUF files --------------------------------------------------------------------

_REAL_FACTS: dict[str, dict[str, Any]] = {
    "smollm2_gguf": {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
    "gemma3_gguf": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 18,
        "hidden_size": 640,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "vocab_size": 262144,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "tie_word_embeddings": True,
    },
    "qwen25_gguf": {
        "model_type": "qwen2",
        "num_hidden_layers": 24,
        "hidden_size": 896,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    },
}

# GGUF tensors checked against transformers' own GGUF conversion: a llama q/k (row
# permutation), gemma norms (the +1), biases, embeddings, an untied head.
_REAL_TENSORS: dict[str, tuple[str, ...]] = {
    "smollm2_gguf": (
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.7.attn_k.weight",
        "blk.0.attn_v.weight",
        "blk.29.ffn_down.weight",
        "blk.3.attn_norm.weight",
        "output_norm.weight",
    ),
    "gemma3_gguf": (
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.0.ffn_down.weight",
        "blk.2.attn_q_norm.weight",
        "blk.2.attn_k_norm.weight",
        "blk.5.post_attention_norm.weight",
        "blk.5.ffn_norm.weight",
        "blk.5.post_ffw_norm.weight",
        "output_norm.weight",
    ),
    "qwen25_gguf": (
        "output.weight",
        "token_embd.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_q.bias",
        "blk.1.attn_k.weight",
        "blk.2.ffn_down.weight",
        "blk.0.ffn_norm.weight",
    ),
}


@pytest.fixture(scope="module", params=sorted(_REAL_FACTS))
def real_gguf(request: pytest.FixtureRequest) -> tuple[str, Path, LoadedModel]:
    """Each real GGUF loaded once (one at a time: they are large in float32)."""
    path = request.getfixturevalue(request.param)
    return request.param, path, load(path, keep_quantized=False)


@pytest.mark.real_model
def test_real_gguf_config(real_gguf: tuple[str, Path, LoadedModel]) -> None:
    key, path, loaded = real_gguf
    for name, value in _REAL_FACTS[key].items():
        assert loaded.config[name] == value, name
    assert loaded.context_length == loaded.config["max_position_embeddings"]
    assert (loaded.quantized, loaded.dtype, loaded.source, loaded.name) == (
        False,
        "float32",
        path,
        path.stem,
    )
    if key == "gemma3_gguf":
        kinds = loaded.config["layer_types"]
        assert kinds[5] == kinds[11] == kinds[17] == "full_attention"
        assert kinds.count("sliding_attention") == 15
        assert loaded.chat_template is None
    else:
        assert loaded.chat_template and "<|im_start|>" in loaded.chat_template
        im_end = loaded.tokenizer.token_to_id("<|im_end|>")
        assert im_end in loaded.eos_token_ids


@pytest.mark.real_model
def test_real_gguf_tensors_match_transformers(real_gguf: tuple[str, Path, LoadedModel]) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    key, path, loaded = real_gguf
    gf = GGUFFile(path)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**loaded.config)
        )
    processor = TENSOR_PROCESSORS.get(gf.architecture, TensorProcessor)(config=loaded.config)
    names = get_gguf_hf_weights_map(hf_model, processor)
    params = dict(tree_flatten(loaded.model.parameters()))
    for gguf_name in _REAL_TENSORS[key]:
        info = gf.tensors[gguf_name]
        ours = np.array(params[names[gguf_name]])
        assert ours.shape == info.shape, gguf_name
        # vocabulary-sized matrices: the first rows suffice (no transform mixes rows there)
        rows = 1024 if info.shape[0] > 100_000 else info.shape[0]
        values = reference_dequantize(np.array(gf.raw(gguf_name)[:rows]), QT(info.ggml_type))
        shape = (rows, *info.shape[1:])
        expected = processor.process(weights=values.reshape(shape), name=gguf_name).weights
        assert np.array_equal(ours[:rows], expected), gguf_name


@pytest.mark.real_model
def test_real_gguf_chat_models_answer(real_gguf: tuple[str, Path, LoadedModel]) -> None:
    key, _, loaded = real_gguf
    if key == "gemma3_gguf":
        pytest.skip("the Gemma 3 270M file is a base model")
    prompt = (
        "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    caches = loaded.model.make_caches()
    tokens = mx.array([loaded.tokenizer.encode_prompt(prompt)])
    out: list[int] = []
    for _ in range(6):
        logits = loaded.model(tokens, caches)
        token = int(np.array(mx.argmax(logits[0, -1])))
        if token in loaded.eos_token_ids:
            break
        out.append(token)
        tokens = mx.array([[token]])
    assert "Paris" in loaded.tokenizer.decode(out)


@pytest.mark.real_model
def test_affine_blocks_equal_mlx_own_gguf_reader(smollm2_gguf: Path) -> None:
    """mx.load reads Q4_1/Q8_0 GGUF tensors as MLX triplets itself: ours are identical."""
    from runtime.load.gguf.quants import to_affine

    theirs = mx.load(str(smollm2_gguf))
    assert isinstance(theirs, dict)
    gf = GGUFFile(smollm2_gguf)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.9.ffn_down.weight"):
        affine = to_affine(gf.raw(name), gf.tensors[name].ggml_type)
        assert affine is not None
        stem = name.removesuffix(".weight")
        assert np.array_equal(affine.weight, np.array(theirs[name]))
        for part, ours in (("scales", affine.scales), ("biases", affine.biases)):
            assert np.array_equal(ours, np.array(theirs[f"{stem}.{part}"].astype(mx.float32)))


def _mapped_rss_kb(path: Path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside, name = 0, False, str(path.resolve())  # smaps names the file itself
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = line.rstrip().endswith(name)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.real_model
def test_a_converted_tensors_pages_leave_resident_memory(smollm2_gguf: Path) -> None:
    """`release` drops a tensor's pages from the process's resident set (the load's peak
    no longer holds the mapped file beside the converted weights); a later read sees the
    same bytes."""
    if not Path("/proc/self/smaps").exists():
        pytest.skip("no /proc/self/smaps here")
    gf = GGUFFile(smollm2_gguf)
    name = max(gf.tensors, key=lambda n: gf.tensors[n].nbytes)
    before = gf.raw(name).copy()  # every page of it touched
    touched = _mapped_rss_kb(smollm2_gguf)
    assert touched * 1024 >= gf.tensors[name].nbytes
    gf.release(name)
    assert _mapped_rss_kb(smollm2_gguf) * 1024 < touched * 1024 - gf.tensors[name].nbytes // 2
    assert np.array_equal(gf.raw(name), before)
