"""Tiny random transformers models written as FP8 block-scaled checkpoints, the way
DeepSeek's and Qwen's FP8 releases store them (`quantization_config` quant_method
"fp8", each quantized Linear's weight as float8_e4m3fn with a `weight_scale_inv` per
block, unconverted modules as bfloat16), and the oracle: transformers' float32 model
loaded from the same checkpoint with every fp8 weight replaced by value x scale.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import Variant, write_tokenizer

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE = "_scale_inv"


@dataclass(frozen=True)
class Fp8Case:
    """A tiny model and how its FP8 checkpoint is written."""

    variant: Variant
    block: tuple[int, int] | None = (128, 128)  # None: one scale per tensor
    scale_dtype: torch.dtype = torch.float32  # torch.float8_e8m0fnu: scale_fmt "ue8m0"
    # modules the checkpoint leaves in bfloat16 (its modules_to_not_convert)
    not_converted: tuple[str, ...] = ("lm_head",)
    extra_config: Mapping[str, Any] = field(default_factory=dict)


def _skipped(name: str, case: Fp8Case) -> bool:
    """Tensors a FP8 conversion leaves alone: all but the decoder's Linear weights (norms,
    embeddings, the MoE router), and the modules it was told not to convert."""
    module = name.removesuffix(".weight")
    return (
        not name.startswith("model.layers.")
        or not name.endswith(".weight")
        or "norm" in name
        or name.endswith("mlp.gate.weight")
        or any(module == m or module.startswith(m + ".") for m in case.not_converted)
    )


def _layer(name: str) -> int:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return -1 if match is None else int(match[1])


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] | None, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 values, their scales as stored, value x scale in float32) of a 2-D weight:
    each block scaled so that its largest magnitude maps to FP8_MAX (ue8m0 scales:
    rounded up to a power of two); the last blocks may be partial."""
    rows, cols = weight.shape
    b0, b1 = block or (rows, cols)
    g0, g1 = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(g0 * b0, g1 * b1)
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(g0, b0, g1, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8) / FP8_MAX
    if scale_dtype == torch.float8_e8m0fnu:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scale = scale.to(scale_dtype).float()  # the factor as the file holds it
    scaled = (blocks / scale[:, None, :, None]).reshape(g0 * b0, g1 * b1)[:rows, :cols]
    values = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    full = scale.repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)[:rows, :cols]
    stored = scale.to(scale_dtype) if block is not None else scale.reshape(()).to(scale_dtype)
    return values, stored, values.float() * full


def write_fp8(case: Fp8Case, source: Path, fp8_dir: Path, oracle_dir: Path) -> dict[str, Any]:
    """`source`'s checkpoint (transformers' save) as an FP8 folder at `fp8_dir` and its
    dequantized twin at `oracle_dir`; returns {name: (original, dequantized)} of the
    fp8 weights."""
    tensors = load_file(str(source / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    rounded: dict[str, Any] = {}
    for name, value in tensors.items():
        if value.ndim != 2 or _skipped(name, case):
            kept = value.to(torch.bfloat16) if value.is_floating_point() else value
            if name.endswith("e_score_correction_bias"):
                kept = value  # DeepSeek keeps its router's bias in float32
            fp8[name] = floats[name] = kept
            continue
        values, scale, dequantized = quantize_fp8(value, case.block, case.scale_dtype)
        fp8[name], fp8[name + SCALE] = values, scale
        floats[name] = dequantized
        rounded[name] = (value, dequantized)
    config = json.loads((source / "config.json").read_text())
    # transformers has no place for DeepSeek's MTP layers (the fp8 folder keeps them)
    floats = {k: v for k, v in floats.items() if _layer(k) < config["num_hidden_layers"]}
    for folder, weights in ((fp8_dir, fp8), (oracle_dir, floats)):
        folder.mkdir()
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        write_tokenizer(folder, int(config["vocab_size"]))
    (oracle_dir / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(case.block) if case.block else None,
        "modules_to_not_convert": list(case.not_converted),
        **({"scale_fmt": "ue8m0"} if case.scale_dtype == torch.float8_e8m0fnu else {}),
        **case.extra_config,
    }
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return rounded


def oracle(folder: Path) -> Any:
    """transformers' float32 model of a (dequantized) checkpoint folder."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def rewrite(
    src: Path,
    dst: Path,
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Path:
    """A copy of the FP8 folder `src` at `dst` with its quantization_config and tensors
    edited in place by the callbacks (files a converter would not write)."""
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        config(data["quantization_config"])
        (dst / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        weights = load_file(str(dst / "model.safetensors"))
        tensors(weights)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
