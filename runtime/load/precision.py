"""How one load holds its weights on this device (`Precision`; the reasons are in
runtime/load/loader.py's docstring), and `QuantizeSpec`, the `--quantize` recipe."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from runtime import backend
from runtime.kernels import quantized_ready
from runtime.load.affine import affine_quantize

log = logging.getLogger(__name__)

QUANTIZE_BITS = (4, 8)
QUANTIZE_GROUPS = (32, 64, 128)
DEFAULT_QUANTIZE_GROUP = 64
# Under q4 the token embeddings and the output head are quantized to 8 bits, as llama.cpp's
# Q4_K_M keeps its head at 6 bits: the head's errors go straight into every logit, and an
# embedding row is read once per token (its size, not its bandwidth, is what it costs).
EDGE_BITS = 8
_EDGE_MODULES = ("embed_tokens", "lm_head")
# MoE routers stay float: a router has no quantized form in some models (sigmoid gates)
# and routing is precision-sensitive (a near-tie can swap experts).
_ROUTERS = (".mlp.gate", "shared_expert_gate")
_QUANTIZE_NAME = re.compile(r"^q(\d+)$")


def is_vision(name: str) -> bool:
    """A vision tower's parameter or module (never quantized by `--quantize`)."""
    return "vision" in name or name.startswith(("visual.", "model.visual."))  # Qwen's: visual


def is_router(path: str) -> bool:
    return path.endswith(_ROUTERS)


def is_expert_stack(name: str) -> bool:
    """Stacked (SwitchLinear) or per-expert weights that a sanitize stacks."""
    return ".switch_mlp." in name or ".experts." in name


@dataclass(frozen=True)
class QuantizeSpec:
    """`--quantize qB --quantize-group G`: every float Linear of the language model whose
    input width G divides is quantized at load to MLX affine B bits, groups of G along the
    input; the token embeddings and output head to `EDGE_BITS` when B is lower; vision
    towers and MoE routers stay float; stacked MoE experts are quantized where they stay
    quantized (not on the CPU: see `Precision`)."""

    bits: int
    group_size: int = DEFAULT_QUANTIZE_GROUP

    def __post_init__(self) -> None:
        if self.bits not in QUANTIZE_BITS:
            raise ValueError(f"quantize to {self.bits} bits: use q4 or q8")
        if self.group_size not in QUANTIZE_GROUPS:
            groups = ", ".join(map(str, QUANTIZE_GROUPS))
            raise ValueError(f"quantize group {self.group_size}: use one of {groups}")

    @classmethod
    def parse(cls, name: str, group_size: int = DEFAULT_QUANTIZE_GROUP) -> QuantizeSpec:
        """ "q4" / "q8" (with a group size) as a spec; a ValueError names what is accepted."""
        match = _QUANTIZE_NAME.match(name.strip().lower())
        if match is None:
            raise ValueError(f"quantize {name!r}: use q4 or q8")
        return cls(int(match.group(1)), group_size)

    @property
    def name(self) -> str:
        """The weight format it produces, e.g. "q4g64"."""
        return f"q{self.bits}g{self.group_size}"

    def bits_for(self, module: str) -> int:
        edge = module.rsplit(".", 1)[-1] in _EDGE_MODULES
        return max(self.bits, EDGE_BITS) if edge else self.bits


@dataclass(frozen=True)
class Precision:
    """How one load holds quantized weights (the compute dtype is resolved per source).

    ``keep_quantized``: quantized sources stay quantized. ``cpu``: the CPU's layout:
    scales/biases of exact repacks as float16 where the source's are float16 values, else
    float32 (on accelerators: the compute dtype, as MLX's kernels return it); types with
    no exact affine form re-quantized to 8 bits with float16
    scales. ``experts_quantized``: stacked MoE experts stay quantized (not on the CPU by
    default: MLX's CPU gather_qmm is a scalar loop). ``quantize``: `--quantize`.
    """

    keep_quantized: bool
    cpu: bool
    experts_quantized: bool
    quantize: QuantizeSpec | None = None

    @classmethod
    def choose(cls, keep_quantized: bool | None, quantize: QuantizeSpec | None = None) -> Precision:
        """This device's policy; ``keep_quantized`` True or False overrides it (True keeps
        every quantized weight, experts too, whatever the device)."""
        cpu = backend.on_cpu()
        if quantize is not None and keep_quantized is False:
            raise ValueError(
                f"--quantize {quantize.name} keeps weights quantized; "
                "it cannot load them dequantized (keep_quantized=False)"
            )
        if keep_quantized is None:
            ready = quantized_ready()
            if quantize is not None and not ready:
                raise ValueError(
                    f"--quantize {quantize.name}: the CPU quantized kernels are not loaded, "
                    "and MLX's own CPU quantized matmul is a scalar single-thread loop; "
                    "serve the model unquantized, or reinstall (pip install -e .) to build them"
                )
            return cls(ready, cpu, ready and not cpu, quantize)
        return cls(keep_quantized, cpu, keep_quantized, quantize)

    def scales_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """Storage of a GGUF repack's scales/biases (``dtype``: the compute dtype): float16
        on the CPU (exact for the legacy types, rounded for the K-quants: see
        runtime/load/gguf/quants.py), the compute dtype elsewhere."""
        return mx.float16 if self.cpu else dtype

    def requantized_scales_dtype(self, dtype: mx.Dtype) -> mx.Dtype:
        """Storage of re-quantized scales/biases (runtime/load/affine.py fits the grid to
        them): float16 on the CPU."""
        return mx.float16 if self.cpu else dtype


def log_dequantized_experts(count: int) -> None:
    if count:
        log.info(
            "%d quantized MoE expert stacks loaded as floats: MLX's CPU gather_qmm is a "
            "scalar loop (keep_quantized=True keeps them quantized)",
            count,
        )


def quantize_targets(model: Any, spec: QuantizeSpec, precision: Precision) -> dict[str, int]:
    """Module path -> bits of every module `spec` quantizes in ``model`` (built, weights
    not loaded): float Linear/Embedding (2-D) and, when experts stay quantized, stacked
    experts (3-D), whose input width the group divides."""
    targets: dict[str, int] = {}
    narrow: list[str] = []
    for path, module in model.named_modules():
        if not path or is_vision(path) or is_router(path):
            continue
        if not hasattr(module, "to_quantized") or "weight" not in module:
            continue
        weight = module["weight"]
        if not isinstance(weight, mx.array) or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        if weight.ndim != 2 and not (weight.ndim == 3 and precision.experts_quantized):
            continue
        if weight.shape[-1] % spec.group_size:
            narrow.append(path)
            continue
        targets[path] = spec.bits_for(path)
    if narrow:
        log.info(
            "--quantize %s: %d modules stay float (input width not a multiple of %d): %s",
            spec.name,
            len(narrow),
            spec.group_size,
            ", ".join(narrow[:4]) + (" ..." if len(narrow) > 4 else ""),
        )
    return targets


def quantization_of(targets: Mapping[str, int], group_size: int) -> dict[str, dict[str, Any]]:
    """`quantize_modules`' per-module parameters for `targets`."""
    return {m: {"bits": b, "group_size": group_size, "mode": "affine"} for m, b in targets.items()}


def quantize_weights(
    model: Any, weights: dict[str, mx.array], precision: Precision, dtype: mx.Dtype
) -> dict[str, dict[str, Any]]:
    """`--quantize`: the float weights (sanitized names) of the modules it takes become
    MLX affine triplets in ``weights``, one tensor at a time (each is read, quantized and
    let go before the next: a bf16 model never sits in memory whole as float32); returns
    their `quantize_modules` parameters."""
    spec = precision.quantize
    if spec is None:
        return {}
    targets = {
        m: bits
        for m, bits in quantize_targets(model, spec, precision).items()
        if f"{m}.weight" in weights
    }
    scales_dtype = precision.requantized_scales_dtype(dtype)
    for module, bits in targets.items():
        q, scales, biases = affine_quantize(
            weights[f"{module}.weight"],
            group_size=spec.group_size,
            bits=bits,
            scales_dtype=scales_dtype,
        )
        mx.eval(q, scales, biases)
        weights[f"{module}.weight"] = q
        weights[f"{module}.scales"] = scales
        weights[f"{module}.biases"] = biases
    return quantization_of(targets, spec.group_size)
