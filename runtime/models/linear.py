"""The linear layer every architecture uses: MLX's, plus the CPU's few-rows kernel.

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
from mlx.nn.layers.linear import Linear as _MLXLinear

from runtime import kernels as cpu_kernels

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
