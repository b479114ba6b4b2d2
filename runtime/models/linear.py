"""The linear and embedding layers every architecture uses: MLX's, plus the CPU kernels.

Quantized, they multiply through `runtime.kernels.qmatmul`: the CPU's MLX primitive
(runtime/kernels/ext) where it is loaded, MLX's own quantized matmul elsewhere. A model
gets them from `nn.quantize`, which asks each layer's `to_quantized`.

A decode step multiplies one row per running sequence by every weight matrix. On the CPU
that is a matter of reading the weights once, which runtime/kernels/bridge.py's
small GEMM does; Metal, CUDA, quantized weights and prefill-sized inputs stay on MLX.

The kernel runs outside MLX's lazy graph: each call evaluates its input, a sync that
costs about as much as a small matrix's product. So it pays for a block (one decoder
layer) whose matrices are big enough that reading each once wins (Qwen2.5-0.5B's 17 MB
MLP matrices: 8 rows step in 194 ms with the kernel, 243 ms without), and not for one
whose matrices stay in the caches (SmolLM2's 3 MB ones: 118 ms with it, 79 ms without,
MLX evaluating the whole layer as one graph). `choose_small_gemm` decides per block,
all of a block's linears alike: one kernel call in a layer already breaks its graph.
"""

from __future__ import annotations

import re
from collections import defaultdict

import mlx.core as mx
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding as _MLXEmbedding
from mlx.nn.layers.linear import Linear as _MLXLinear
from mlx.nn.layers.quantized import QuantizedEmbedding as _MLXQuantizedEmbedding
from mlx.nn.layers.quantized import QuantizedLinear as _MLXQuantizedLinear

from runtime import kernels as cpu_kernels
from runtime.kernels import lanes

# a block whose largest float matrix is smaller than this stays on MLX's GEMM
BLOCK_MIN_WEIGHT_BYTES = 8 << 20
_BLOCK = re.compile(r"^(.*?layers\.\d+)\.")


class Linear(_MLXLinear):
    small_gemm = True  # whether a few rows go to the CPU kernel (`choose_small_gemm`)

    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.linear(x, self.weight) if self.small_gemm else None
        if out is None:
            return super().__call__(x)
        return out + self.bias if "bias" in self else out

    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> QuantizedLinear:
        if quantize_input:
            raise ValueError("quantized inputs are not supported")
        # None: MLX takes the mode's defaults (its stubs say int)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)  # type: ignore[arg-type]


class QuantizedLinear(_MLXQuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.qmatmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return out + self["bias"] if "bias" in self else out


def packed(layer: object) -> cpu_kernels.Packed | None:
    """A quantized linear layer's arrays as the CPU's multi-product primitive takes them;
    None for any other layer."""
    if not isinstance(layer, QuantizedLinear) or layer.mode != "affine":
        return None
    w, scales, biases, bias = (
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        layer.get("bias"),
    )
    # kept beside the layer's parameters (a decode step asks for every layer's), and
    # remade when any of its arrays was replaced (a weight update)
    held: cpu_kernels.Packed | None = layer.__dict__.get("_packed")
    if (
        held is not None
        and held.w is w
        and held.scales is scales
        and held.biases is biases
        and held.bias is bias
    ):
        return held
    made = cpu_kernels.Packed(w, scales, biases, bias, layer.group_size, layer.bits)
    object.__setattr__(layer, "_packed", made)
    return made


def fused_products(
    x: mx.array, layers: tuple[object, ...], activation: str = ""
) -> list[mx.array] | None:
    """The layers' outputs for one input as one CPU primitive (q, k and v; or a gated
    pair with `activation`, one output): None unless every layer is quantized and the
    primitive runs here, and the caller calls the layers one by one."""
    parts = [packed(layer) for layer in layers]
    if any(p is None for p in parts):
        return None
    return cpu_kernels.qmatmuls(x, [p for p in parts if p is not None], activation)


class Embedding(_MLXEmbedding):
    def to_quantized(
        self,
        group_size: int | None = None,
        bits: int | None = None,
        mode: str = "affine",
        quantize_input: bool = False,
    ) -> QuantizedEmbedding:
        if quantize_input:
            raise ValueError("quantized inputs are not supported")
        # None: MLX takes the mode's defaults (its stubs say int)
        return QuantizedEmbedding.from_embedding(self, group_size, bits, mode)  # type: ignore[arg-type]


class QuantizedEmbedding(_MLXQuantizedEmbedding):
    """Looking up rows dequantizes only those rows; a tied output head multiplies
    through `qmatmul`."""

    def __call__(self, x: mx.array) -> mx.array:
        # MLX dequantizes in the scales' dtype: on the CPU (float32 compute, float16
        # scales where exact) the rows are dequantized in float32, as `qmatmul` does
        if self.mode != "affine":
            out: mx.array = super().__call__(x)
            return out
        if lanes.in_lanes(self["weight"]):  # gathered from their strips (`use_lanes`)
            w, scales, stored = lanes.rows(
                self["weight"], self["scales"], self.get("biases"), x.flatten(), self.bits
            )
            w, scales = w.reshape(*x.shape, -1), scales.reshape(*x.shape, -1)
            stored = None if stored is None else stored.reshape(*x.shape, -1)
        else:
            w, scales, stored = self["weight"][x], self["scales"][x], None
            if "biases" in self:
                stored = self["biases"][x]
        biases = stored if stored is not None else cpu_kernels.symmetric_biases(scales, self.bits)
        cpu = mx.default_device() == mx.cpu
        out = mx.dequantize(
            w,
            scales=scales.astype(mx.float32),
            biases=biases.astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return out if cpu else out.astype(scales.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.qmatmul(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def choose_small_gemm(model: object) -> None:
    """Per block of `model` (a `...layers.N` subtree; anything else is its own block),
    whether its linears use the CPU's few-rows kernel (see the module docstring)."""
    if not isinstance(model, Module):
        return
    blocks: dict[str, list[Linear]] = defaultdict(list)
    for path, module in model.named_modules():
        if isinstance(module, Linear):
            hit = _BLOCK.match(path + ".")
            blocks[hit.group(1) if hit else path].append(module)
    for linears in blocks.values():
        largest = max(int(m.weight.nbytes) for m in linears)
        for m in linears:
            m.small_gemm = largest >= BLOCK_MIN_WEIGHT_BYTES


def drop_symmetric_biases(model: object) -> int:
    """Keep symmetric weights without their biases on the CPU: bytes freed.

    GGUF's Q4_0, Q5_0 and Q8_0 store value = d * (q - 2^(bits - 1)): as MLX's affine
    groups, each bias is -2^(bits - 1) times its scale, and storing it costs a weight
    0.0625 bytes of the 0.5625-1.0625 it takes in the file (Qwen2.5-Coder-0.5B's Q4_K_M:
    25 MB read every decode step). The CPU primitives compute the bias from the scale
    (MLXGW_SYMMETRIC); `qmatmul`, `dequantize` and the embedding make it where MLX's ops
    run. Only our linear and embedding layers, and only where every bias equals it
    exactly; elsewhere (Metal, CUDA, no extension) the biases stay."""
    if not isinstance(model, Module) or cpu_kernels.active() is None:
        return 0
    freed = 0
    for _, layer in model.named_modules():
        if type(layer) not in (QuantizedLinear, QuantizedEmbedding):
            continue
        if layer.mode != "affine" or "biases" not in layer or layer["weight"].ndim != 2:
            continue
        biases, scales = layer["biases"], layer["scales"]
        if (
            biases.dtype != scales.dtype
            or not mx.array_equal(biases, cpu_kernels.symmetric_biases(scales, layer.bits)).item()
        ):
            continue
        freed += biases.nbytes
        del layer["biases"]
        object.__setattr__(layer, "biases", None)  # MLX's layers read `self.biases`
    return freed


def use_lanes(model: object) -> int:
    """Keep the 4-, 5-, 6- and 8-bit linear layers' weights in 16-feature lanes on a CPU whose
    decode kernel multiplies 16 features per block (runtime/kernels/lanes.py; qlanes.c
    on AVX-512 VNNI, qlanes2.c on AVX2): the number of layers moved. The same bytes, permuted; every CPU primitive
    reads either layout, and MLX's ops get the standard one back. A 4- or 8-bit
    embedding moves too (its lookup gathers rows from their strips; a tied output head
    is its biggest product). Nothing moves where `lanes_ready` is false, nor a layer
    whose parent reads its arrays itself (the parent's `reads_weights`)."""
    if not isinstance(model, Module) or not cpu_kernels.lanes_ready():
        return 0
    moved = 0
    sw = cpu_kernels.switches()
    modules = model.named_modules()
    # children a module reads the arrays of itself (its `reads_weights`) stay standard
    kept = {
        f"{path}.{child}" if path else child
        for path, module in modules
        for child in getattr(module, "reads_weights", ())
    }
    for path, layer in modules:
        if type(layer) not in (QuantizedLinear, QuantizedEmbedding) or layer.mode != "affine":
            continue
        if path in kept:
            continue
        w, scales = layer["weight"], layer["scales"]
        if not lanes.fits(w, scales, layer.bits, layer.group_size):
            continue
        if isinstance(layer, QuantizedEmbedding) and layer.bits not in (4, 8):
            continue  # a lookup gathers 4- and 8-bit rows (`lanes.rows`)
        w, scales, biases = lanes.to_lanes(
            w, scales, layer.get("biases"), layer.bits, ext=sw.ext, threads=sw.threads
        )
        layer["weight"], layer["scales"] = w, scales
        if biases is not None:
            layer["biases"] = biases
        moved += 1
    return moved
