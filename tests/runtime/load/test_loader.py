"""Loading: GGML block decoding, GGUF -> HF tensor names and llama.cpp's transforms, HF
and MLX-quantized folders, folders quantized by methods we refuse. GGUF files end to end:
tests/runtime/load/test_loader_gguf.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from gguf import get_tensor_name_map
from gguf.constants import GGML_QUANT_SIZES, MODEL_ARCH_NAMES
from gguf.constants import GGMLQuantizationType as QT
from gguf.quants import dequantize as reference_dequantize
from mlx.utils import tree_flatten

from runtime.kernels import quantized_ready
from runtime.load.gguf.names import hf_name, unpermute_rows
from runtime.load.gguf.quants import dequantize, to_affine
from runtime.load.loader import load
from tests.support.gguf_helpers import TOKENS, llama_cpp_permute, our_logits, torch_logits

# -- GGML block decoding ---------------------------------------------------------------------

# type -> byte offsets of its fp16 block scales (random bytes there could be inf/nan)
_FP16_FIELDS = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}


def _random_blocks(qtype: QT, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _FP16_FIELDS[qtype]:
        scales = (rng.standard_normal((raw.shape[0], 1)) * 0.05).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize(
    "qtype", [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K], ids=str
)
def test_blocks_convert_exactly_to_mlx_affine(qtype: QT) -> None:
    raw = _random_blocks(qtype, rows=40, cols=512)
    expected = reference_dequantize(raw, qtype)
    assert np.array_equal(dequantize(raw, int(qtype), (40, 512)), expected)
    affine = to_affine(raw, int(qtype))
    assert affine is not None
    got = mx.dequantize(
        mx.array(affine.weight),
        mx.array(affine.scales),
        mx.array(affine.biases),
        group_size=affine.group_size,
        bits=affine.bits,
    )
    assert np.array_equal(np.array(got), expected)
    rows = np.array([3, 1, 2])
    picked = affine.take_rows(rows)
    assert np.array_equal(picked.weight, affine.weight[rows])


def test_types_without_affine_form_use_the_reference_decoder() -> None:
    raw = _random_blocks(QT.Q6_K, rows=4, cols=256)
    assert to_affine(raw, int(QT.Q6_K)) is None
    assert np.array_equal(
        dequantize(raw, int(QT.Q6_K), (4, 256)), reference_dequantize(raw, QT.Q6_K)
    )


# -- names and llama.cpp's transforms ------------------------------------------------------


def test_unpermute_rows_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 2, 6):
        assert np.array_equal(llama_cpp_permute(w, heads)[unpermute_rows(48, heads)], w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_names_agree_with_gguf_tensor_map(arch: str) -> None:
    """Our GGUF -> HF names are the inverse of gguf-py's HF -> GGUF map."""
    gemma = arch == "gemma3"
    parts = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    parts += ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    parts += ["post_attention_layernorm"]
    if gemma or arch == "qwen3":
        parts += ["self_attn.q_norm", "self_attn.k_norm"]
    if gemma:
        parts += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    hf = ["model.embed_tokens", "model.norm", "lm_head", *(f"model.layers.3.{p}" for p in parts)]
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    name_map = get_tensor_name_map(arch_id, 4)
    for name in hf:
        gguf_name = name_map.get_name(name)
        assert gguf_name is not None, name
        assert hf_name(f"{gguf_name}.weight", arch) == f"{name}.weight"
    assert hf_name("blk.0.attn_q.bias", arch) == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.0.something_new.weight", arch) is None


# -- HF and MLX-quantized folders -----------------------------------------------------------


def _write_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    tok = HFTokenizer(models.WordLevel(vocab=words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "w2", "bos_token": "w1", "chat_template": "{{ x }}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    pytest.importorskip("transformers")
    from tests.support.tiny_models import make_tiny

    folder = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny("llama", folder)
    _write_tokenizer(folder, model.config.vocab_size)
    return folder, model


def test_hf_folder_loads_and_matches_transformers(tiny_llama_folder: tuple[Path, Any]) -> None:
    folder, model = tiny_llama_folder
    loaded = load(folder)
    np.testing.assert_allclose(
        our_logits(loaded, TOKENS), torch_logits(model, TOKENS), atol=2e-4, rtol=1e-4
    )
    assert loaded.chat_template == "{{ x }}"
    assert loaded.eos_token_ids >= {2, 7}
    assert loaded.tokenizer.encode("w5 w9") == [5, 9]
    assert (loaded.name, loaded.quantized, loaded.dtype) == (folder.name, False, "float32")
    assert loaded.context_length == model.config.max_position_embeddings


def _quantize_folder(src: Path, dst: Path) -> dict[str, mx.array]:
    """An MLX-quantized copy of ``src`` (4-bit, lm_head 8-bit): returns the float
    weights the quantized ones stand for."""
    dst.mkdir()
    weights = mx.load(str(src / "model.safetensors"))
    assert isinstance(weights, dict)
    out: dict[str, mx.array] = {}
    expected: dict[str, mx.array] = {}
    for name, value in weights.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and value.ndim == 2 and "embed" not in name:
            bits = 8 if module == "lm_head" else 4
            w, s, b = mx.quantize(value, group_size=32, bits=bits)
            out.update({name: w, f"{module}.scales": s, f"{module}.biases": b})
            expected[name] = mx.dequantize(w, s, b, group_size=32, bits=bits)
        else:
            out[name] = value
            expected[name] = value
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4, "lm_head": {"group_size": 32, "bits": 8}}
    (dst / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_text((src / name).read_text())
    return expected


def test_mlx_quantized_folder(tiny_llama_folder: tuple[Path, Any], tmp_path: Path) -> None:
    folder, _ = tiny_llama_folder
    expected = _quantize_folder(folder, tmp_path / "q")
    loaded = load(tmp_path / "q", keep_quantized=False)  # dequantized to float32
    assert loaded.quantized is False
    params = dict(tree_flatten(loaded.model.parameters()))
    for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight"):
        assert params[name].dtype == mx.float32
        assert np.array_equal(np.array(params[name]), np.array(expected[name]))
    kept = load(tmp_path / "q", keep_quantized=True)
    assert kept.quantized is True and kept.dtype == "float32"  # the scales' dtype
    assert load(tmp_path / "q").quantized is quantized_ready()  # the default policy
    kept_params = dict(tree_flatten(kept.model.parameters()))
    assert kept_params["lm_head.weight"].dtype == mx.uint32
    np.testing.assert_allclose(
        our_logits(kept, TOKENS), our_logits(loaded, TOKENS), atol=1e-4, rtol=1e-4
    )


def _with_config(src: Path, dst: Path, **entries: Any) -> Path:
    """A copy of the folder ``src`` with ``entries`` set in its config.json."""
    dst.mkdir()
    for file in src.iterdir():
        if file.is_file() and file.name != "config.json":
            (dst / file.name).write_bytes(file.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **entries}))
    return dst


_ALTERNATIVES = ("unquantized", "MLX-quantized folder", "FP8 block-scaled", "GGUF")
_FOREIGN_METHODS = [
    "compressed-tensors",
    "gptq",
    "awq",
    "mxfp4",
    "bitsandbytes",
    "hqq",
    "eetq",
    "aqlm",
    "quanto",
    "torchao",
    "exl2",
    "fbgemm_fp8",
    "bitnet",
    "GPTQ",  # spelled as the config spells it
    "some-future-method",
]


@pytest.mark.parametrize("method", _FOREIGN_METHODS)
def test_foreign_quantization_is_refused_naming_it(
    tiny_llama_folder: tuple[Path, Any], tmp_path: Path, method: str
) -> None:
    """Refused from the config alone (the weights here are plain ones that would load;
    with "bits" the config used to pass for an MLX-quantized one)."""
    folder, _ = tiny_llama_folder
    quant = {"quant_method": method, "bits": 4, "group_size": 128}
    bad = _with_config(folder, tmp_path / "bad", quantization_config=quant)
    with pytest.raises(ValueError) as info:
        load(bad)
    message = str(info.value)
    assert f"quantization_config.quant_method is {method!r}" in message
    assert "not supported" in message
    assert all(alternative in message for alternative in _ALTERNATIVES), message


_FLOAT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "compressed-tensors", "format": "float-quantized"},
        {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": {**_FLOAT_GROUP, "format": "float-quantized"}},
        },
    ],
    ids=["format", "group_format"],
)
def test_compressed_tensors_fp8_is_refused_naming_its_format(
    tiny_llama_folder: tuple[Path, Any], tmp_path: Path, quant: dict[str, Any]
) -> None:
    folder, _ = tiny_llama_folder
    bad = _with_config(folder, tmp_path / "bad", quantization_config=quant)
    with pytest.raises(ValueError, match=r"'compressed-tensors' \(format 'float-quantized': .*"):
        load(bad)


def test_legacy_bitsandbytes_config_is_refused(
    tiny_llama_folder: tuple[Path, Any], tmp_path: Path
) -> None:
    """Written before transformers named its methods: no quant_method, load_in_4bit."""
    folder, _ = tiny_llama_folder
    quant = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    bad = _with_config(folder, tmp_path / "bad", quantization_config=quant)
    with pytest.raises(ValueError, match="bitsandbytes-quantized checkpoints are not supported"):
        load(bad)


@pytest.mark.parametrize("method", [None, "mlx"])
def test_mlx_quantized_folder_with_quantization_config_loads(
    tiny_llama_folder: tuple[Path, Any], tmp_path: Path, method: str | None
) -> None:
    """mlx-lm writes its "quantization" again as a method-less quantization_config;
    some converters add quant_method "mlx"."""
    folder, _ = tiny_llama_folder
    expected = _quantize_folder(folder, tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    quant = dict(config["quantization"], **({"quant_method": method} if method else {}))
    q = _with_config(tmp_path / "q", tmp_path / "q2", quantization_config=quant)
    params = dict(tree_flatten(load(q, keep_quantized=False).model.parameters()))
    assert np.array_equal(np.array(params["lm_head.weight"]), np.array(expected["lm_head.weight"]))
    assert load(q, keep_quantized=True).quantized is True


def test_load_rejects_missing_and_odd_sources(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope")
    odd = tmp_path / "weights.bin"
    odd.write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a model folder"):
        load(odd)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load(tmp_path)
