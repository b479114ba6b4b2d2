"""Random weights at Qwen2.5-7B's shapes, for bench/quantized.py: the same values as

  an F16 GGUF (qwen2 metadata, the tokenizer metadata and chat template copied from a
      Qwen2.5 GGUF so that every server tokenizes alike),
  a Q4_K_M GGUF made from it by llama.cpp's own quantizer (llama_model_quantize), and
  an MLX 4-bit folder (mx.quantize, group 64, bfloat16 scales: what `mlx_lm.convert -q`
      writes), which mlx-lm and our loader read.

Values are N(0, 0.02) (norm weights 1), drawn per tensor from a seed derived from its
name, so each file can be (re)made alone and still holds the same weights; generation runs
tensor by tensor (in row chunks), so memory stays near one tensor's float16 copy.

    python bench/_random_7b.py [--root ~/.cache/mlx-gateway/bench] [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB = 3584, 28, 28, 4, 18944, 152064
HEAD_DIM = HIDDEN // HEADS
CONTEXT, ROPE_THETA, RMS_EPS = 32768, 1_000_000.0, 1e-6
STD = 0.02
GROUP, BITS = 64, 4
ROW_CHUNK = 4096  # rows generated (and quantized) at once
NAME = "random-qwen2.5-7b"


@dataclass(frozen=True)
class Tensor:
    gguf: str  # llama.cpp's name
    hf: str  # the HF/MLX name
    shape: tuple[int, ...]  # numpy / HF order: (out, in) for matrices

    @property
    def kind(self) -> str:
        if len(self.shape) == 2:
            return "matrix"
        return "norm" if "norm" in self.hf else "bias"


def tensors() -> list[Tensor]:
    """Every tensor, in file order (embedding, the layers, final norm, output head)."""
    out = [Tensor("token_embd.weight", "model.embed_tokens.weight", (VOCAB, HIDDEN))]
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        out += [
            Tensor(b + "attn_norm.weight", m + "input_layernorm.weight", (HIDDEN,)),
            Tensor(b + "attn_q.weight", m + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            Tensor(b + "attn_q.bias", m + "self_attn.q_proj.bias", (HIDDEN,)),
            Tensor(b + "attn_k.weight", m + "self_attn.k_proj.weight", (kv, HIDDEN)),
            Tensor(b + "attn_k.bias", m + "self_attn.k_proj.bias", (kv,)),
            Tensor(b + "attn_v.weight", m + "self_attn.v_proj.weight", (kv, HIDDEN)),
            Tensor(b + "attn_v.bias", m + "self_attn.v_proj.bias", (kv,)),
            Tensor(b + "attn_output.weight", m + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            Tensor(b + "ffn_norm.weight", m + "post_attention_layernorm.weight", (HIDDEN,)),
            Tensor(b + "ffn_gate.weight", m + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            Tensor(b + "ffn_up.weight", m + "mlp.up_proj.weight", (INTER, HIDDEN)),
            Tensor(b + "ffn_down.weight", m + "mlp.down_proj.weight", (HIDDEN, INTER)),
        ]
    out += [
        Tensor("output_norm.weight", "model.norm.weight", (HIDDEN,)),
        Tensor("output.weight", "lm_head.weight", (VOCAB, HIDDEN)),
    ]
    return out


def chunks(t: Tensor) -> Iterator[np.ndarray]:
    """The tensor's float16 values, ROW_CHUNK rows at a time (deterministic per name)."""
    if t.kind == "norm":
        yield np.ones(t.shape, np.float16)
        return
    rng = np.random.default_rng(zlib.crc32(t.gguf.encode()))
    rows = t.shape[0]
    for start in range(0, rows, ROW_CHUNK):
        n = min(ROW_CHUNK, rows - start)
        shape = (n, *t.shape[1:])
        yield (rng.standard_normal(shape, dtype=np.float32) * STD).astype(np.float16)


def values(t: Tensor) -> np.ndarray:
    return np.concatenate(list(chunks(t)), axis=0)


# ---------------------------------------------------------------- the files
@dataclass(frozen=True)
class Files:
    f16: Path
    q4km: Path
    mlx4: Path  # a folder

    @classmethod
    def under(cls, root: Path) -> Files:
        return cls(
            root / f"{NAME}-F16.gguf", root / f"{NAME}-Q4_K_M.gguf", root / f"{NAME}-mlx-4bit"
        )


def hf_config() -> dict[str, Any]:
    quant = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER,
        "vocab_size": VOCAB,
        "max_position_embeddings": CONTEXT,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "quantization": quant,
        "quantization_config": quant,
    }


def write_f16_gguf(out: Path, tokenizer_gguf: Path) -> None:
    import gguf

    reader = gguf.GGUFReader(tokenizer_gguf)
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(tmp, "qwen2")
    writer.add_name(NAME)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _copy_tokenizer(reader, writer, gguf)
    specs = tensors()
    for t in specs:
        dtype = np.float16 if t.kind == "matrix" else np.float32
        writer.add_tensor_info(
            t.gguf, t.shape, np.dtype(dtype), int(np.prod(t.shape)) * dtype().itemsize
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in specs:
        v = values(t)
        writer.write_tensor_data(v if t.kind == "matrix" else v.astype(np.float32))
    writer.close()
    tmp.rename(out)


def _copy_tokenizer(reader: Any, writer: Any, gguf: Any) -> None:
    """tokenizer.* from the source GGUF, its vocabulary padded to VOCAB as llama.cpp's
    converter pads Qwen's ([PADn], type UNUSED)."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        if key == "tokenizer.ggml.tokens":
            value = [*value, *(f"[PAD{i}]" for i in range(len(value), VOCAB))]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *([int(gguf.TokenType.UNUSED)] * (VOCAB - len(value)))]
        writer.add_key_value(key, value, vtype, sub_type=sub)


def quantize_q4km(f16: Path, out: Path, threads: int) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = threads
    tmp = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({f16}) returned {rc}")
    tmp.rename(out)


def write_mlx4(folder: Path, tokenizer_gguf: Path) -> None:
    # lazy: MLX loads after the BLAS preload (runtime.backend), which main() does first
    import mlx.core as mx

    tmp = folder.with_name(folder.name + ".part")
    tmp.mkdir(parents=True, exist_ok=True)
    specs = tensors()
    shards: list[list[Tensor]] = [[specs[0]]]
    shards += [specs[1 + 12 * i : 13 + 12 * i] for i in range(LAYERS)]
    shards.append(specs[1 + 12 * LAYERS :])
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        arrays: dict[str, mx.array] = {}
        for t in shard:
            arrays.update(_mlx_arrays(t, mx))
        mx.save_safetensors(str(tmp / file), arrays, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(arrays, file))
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (tmp / "config.json").write_text(json.dumps(hf_config(), indent=1))
    write_tokenizer(tmp, tokenizer_gguf)
    tmp.rename(folder)


def _mlx_arrays(t: Tensor, mx: Any) -> dict[str, Any]:
    if t.kind != "matrix":
        return {t.hf: mx.array(values(t)).astype(mx.bfloat16)}
    parts: list[tuple[Any, Any, Any]] = []
    for c in chunks(t):  # rows quantize independently: chunking is exact
        w, s, b = mx.quantize(mx.array(c).astype(mx.bfloat16), group_size=GROUP, bits=BITS)
        mx.eval(w, s, b)
        parts.append((w, s, b))
    stem = t.hf.removesuffix(".weight")
    return {
        t.hf: mx.concatenate([p[0] for p in parts]),
        f"{stem}.scales": mx.concatenate([p[1] for p in parts]),
        f"{stem}.biases": mx.concatenate([p[2] for p in parts]),
    }


def write_tokenizer(folder: Path, source: Path) -> None:
    """A GGUF's tokenizer and chat template as a HF folder's tokenizer files."""
    from runtime.load import GGUFFile, tokenizer_from_gguf  # lazy: it imports MLX (see above)

    parsed = GGUFFile(source)
    tok = tokenizer_from_gguf(parsed)
    tok.hf.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": tok.add_bos,
        "chat_template": parsed.metadata.get("tokenizer.chat_template"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# ---------------------------------------------------------------- entry
def ensure(
    root: Path, tokenizer_gguf: Path, threads: int = 2, log: Callable[[str], None] = print
) -> Files:
    """Make whichever of the three files is missing; the paths."""
    files = Files.under(root)
    root.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[Path, Callable[[], None]]] = [
        (files.f16, lambda: write_f16_gguf(files.f16, tokenizer_gguf)),
        (files.q4km, lambda: quantize_q4km(files.f16, files.q4km, threads)),
        (files.mlx4, lambda: write_mlx4(files.mlx4, tokenizer_gguf)),
    ]
    for path, make in steps:
        if path.exists():
            continue
        start = time.perf_counter()
        log(f"writing {path} ...")
        make()
        log(f"  {path.name}: {time.perf_counter() - start:.0f} s, {_size(path) / 1e9:.2f} GB")
    return files


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    from runtime import backend

    backend.configure()
    from gateway.cli.store.store import Store, gateway_home

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--root", type=Path, default=gateway_home() / "bench")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--tokenizer-from", default="qwen2.5-coder-0.5b", help="alias or GGUF path")
    args = p.parse_args()
    source = Path(args.tokenizer_from)
    tokenizer_gguf = source if source.is_file() else Store().resolve(args.tokenizer_from)
    ensure(args.root, tokenizer_gguf, args.threads)


if __name__ == "__main__":
    main()
