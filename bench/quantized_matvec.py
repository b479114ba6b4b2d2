"""The quantized decode kernel (runtime/kernels/quantized.c) against MLX's CPU peers.

For each weight shape (K x N: Qwen2.5-0.5B's MLP and 7B's MLP), rows of x (1: one decode
stream; 8: a batched decode step) and bit width (group 64), three ways to compute
x @ W.T on the CPU, each timed as the median of several runs after a warm-up:

  ours     runtime.kernels.qmatmul on the packed weights (the MLX primitive)
  mlx-q    mx.quantized_matmul on the same packed arrays (MLX's CPU kernel)
  blas     a float32 matmul of the dequantized weight (what the CPU serves today)

and prints the times, the ratios peer/ours (above 1: ours is faster), the packed weight
bytes one call reads (weights, scales, biases) and the rate ours reads them at.

    python bench/quantized_matvec.py [--repeats 7]   (threads: MLX_GATEWAY_CPU_THREADS)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime import backend  # noqa: E402

backend.configure()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from runtime import kernels  # noqa: E402

SHAPES = ((896, 4864), (4864, 896), (3584, 18944), (18944, 3584))  # (K, N)
GROUP = 64


def _seconds(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(depth: int, cols: int, rows: int, bits: int, repeats: int) -> str:
    rng = np.random.default_rng(0)
    weight = mx.array(rng.standard_normal((cols, depth), dtype=np.float32) * 0.02)
    xm = mx.array(rng.standard_normal((rows, depth), dtype=np.float32))
    packed = mx.quantize(weight, group_size=GROUP, bits=bits)
    dense = mx.dequantize(*packed, group_size=GROUP, bits=bits)
    mx.eval(xm, dense, *packed)
    w, scales, biases = packed

    def ours() -> object:
        out = kernels.qmatmul(xm, *packed, group_size=GROUP, bits=bits)
        mx.eval(out)
        return out

    def mlx_q() -> object:
        out = mx.quantized_matmul(xm, *packed, transpose=True, group_size=GROUP, bits=bits)
        mx.eval(out)
        return out

    def blas() -> object:
        out = xm @ dense.T
        mx.eval(out)
        return out

    t_ours, t_mlx, t_blas = (_seconds(f, repeats) for f in (ours, mlx_q, blas))
    nbytes = w.nbytes + scales.nbytes + biases.nbytes
    return (
        f"{depth:>6}x{cols:<6} {rows:>4} {bits:>4} {t_ours * 1e3:>9.3f} {t_mlx * 1e3:>9.3f} "
        f"{t_blas * 1e3:>9.3f} {t_mlx / t_ours:>7.1f}x {t_blas / t_ours:>7.2f}x "
        f"{nbytes / 2**20:>8.1f} {nbytes / t_ours / 1e9:>7.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    if kernels.extension() is None:
        sys.exit("the MLX extension is not built (pip install -e . builds it)")
    print(
        f"{kernels.thread_count()} threads (MLX_GATEWAY_CPU_THREADS), int8 activations "
        f"as MLX_GATEWAY_CPU_ACTIVATIONS says (default int16); BLAS: {backend.blas_choice()}"
    )
    print(
        f"{'K x N':>13} {'rows':>4} {'bits':>4} {'ours ms':>9} {'mlx-q ms':>9} {'blas ms':>9} "
        f"{'mlx-q/us':>8} {'blas/us':>8} {'MiB read':>8} {'GB/s':>7}"
    )
    for depth, cols in SHAPES:
        for rows in (1, 8):
            for bits in (4, 8):
                print(_row(depth, cols, rows, bits, args.repeats), flush=True)


if __name__ == "__main__":
    main()
