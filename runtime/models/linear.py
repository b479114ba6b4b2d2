"""The linear layer every architecture uses: MLX's, plus the CPU's few-rows kernel.

A decode step multiplies one row per running sequence by every weight matrix. On the CPU
that is a matter of reading the weights once, which runtime/models/cpu_kernels.py's
small GEMM does; Metal, CUDA, quantized weights and prefill-sized inputs stay on MLX.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.linear import Linear as _MLXLinear

from runtime.models import cpu_kernels


class Linear(_MLXLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = cpu_kernels.linear(x, self.weight)
        if out is None:
            return super().__call__(x)
        return out + self.bias if "bias" in self else out
