"""The gated delta rule (runtime/models/gated_delta.py) against mlx-lm's, and our chunk sizes.

The peer is mlx-lm's `gated_delta_ops`, what mlx-lm runs off Metal: the recurrence token
by token. Ours runs prefill in chunks (a triangular solve per chunk, one sequential state
update per chunk) and decode token by token. The script prints seconds and the
peer/ours ratio for prefill of one layer's delta rule at each chunk size, for a decode
step, and for a whole GatedDeltaNet layer's prefill (projections, conv, norm included), so
the delta rule's share of the layer shows.

Default dimensions are Qwen3-Next / Qwen3.5-35B-A3B's linear-attention layers: 16 key
heads, 32 value heads, head dims 128, hidden 2048.

    python bench/gated_delta.py [--tokens 2048] [--chunks 16,32,64,128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
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

from runtime.cache import RecurrentCache  # noqa: E402
from runtime.models.gated_delta import (  # noqa: E402
    DeltaNetDims,
    GatedDeltaNet,
    delta_rule_chunked,
    delta_rule_recurrent,
)


def _seconds(run: Callable[[], None], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(tokens: int, heads: int, k_dim: int, v_dim: int) -> tuple[mx.array, ...]:
    mx.random.seed(0)

    def unit(shape: tuple[int, ...]) -> mx.array:
        x = mx.random.normal(shape)
        return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True))

    q = unit((1, heads, tokens, k_dim)) * k_dim**-0.5
    k = unit((1, heads, tokens, k_dim))
    v = mx.random.normal((1, heads, tokens, v_dim))
    g = -mx.random.uniform(0.0, 1.0, (1, heads, tokens))
    beta = mx.random.uniform(0.0, 1.0, (1, heads, tokens))
    state = mx.zeros((1, heads, k_dim, v_dim))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def _peer() -> Callable[..., tuple[mx.array, mx.array]] | None:
    """mlx-lm's gated_delta_ops, loaded from its file: the `mlx_lm` package imports torch,
    and torch's OpenMP runtime in the same process slows MLX's CPU matmuls many times
    over (measured here: 3 s -> 40-120 s for a 2048-token chunked prefill)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "models" / "gated_delta.py"
    module_spec = importlib.util.spec_from_file_location("_peer_gated_delta", path)
    if module_spec is None or module_spec.loader is None:
        return None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    gated_delta_ops = module.gated_delta_ops
    assert "torch" not in sys.modules

    def run(*args: mx.array) -> tuple[mx.array, mx.array]:
        q, k, v, g, beta, state = args
        # mlx-lm: (B, T, H, D) inputs, decay as a factor, state (B, H, Dv, Dk)
        out, new_state = gated_delta_ops(
            q.transpose(0, 2, 1, 3),
            k.transpose(0, 2, 1, 3),
            v.transpose(0, 2, 1, 3),
            mx.exp(g).transpose(0, 2, 1),
            beta.transpose(0, 2, 1),
            state.swapaxes(-1, -2),
        )
        return out, new_state

    return run


def _eval_chunked(inputs: tuple[mx.array, ...], chunk: int) -> None:
    q, k, v, g, beta, state = inputs
    mx.eval(*delta_rule_chunked(q, k, v, g, beta, state, chunk))


def _rule_table(args: argparse.Namespace) -> None:
    q, k, v, g, beta, state = _inputs(args.tokens, args.v_heads, args.head_dim, args.head_dim)
    peer = _peer()
    peer_s = None
    if peer is not None:
        peer_s = _seconds(lambda: mx.eval(*peer(q, k, v, g, beta, state)), args.repeats)
        print(f"prefill {args.tokens} tokens, mlx-lm gated_delta_ops: {peer_s:.3f} s")
    recurrent_s = _seconds(
        lambda: mx.eval(*delta_rule_recurrent(q, k, v, g, beta, state)), args.repeats
    )
    print(
        f"  ours, recurrent            {recurrent_s:8.3f} s   peer/ours {_ratio(peer_s, recurrent_s)}"
    )
    for chunk in args.chunks:
        run = functools.partial(_eval_chunked, (q, k, v, g, beta, state), chunk)
        secs = _seconds(run, args.repeats)
        print(
            f"  ours, chunk {chunk:<4}           {secs:8.3f} s   peer/ours {_ratio(peer_s, secs)}"
        )
    one = [x[:, :, :1] for x in (q, k, v, g, beta)]
    steps = 64

    def decode(fn: Callable[..., tuple[mx.array, mx.array]]) -> Callable[[], None]:
        def run() -> None:
            s = state
            for _ in range(steps):
                out, s = fn(*one, s)
                mx.eval(out, s)

        return run

    ours_step = _seconds(decode(delta_rule_recurrent), args.repeats) / steps
    peer_step = None if peer is None else _seconds(decode(peer), args.repeats) / steps
    print(
        f"decode step: ours {ours_step * 1e3:.3f} ms"
        + ("" if peer_step is None else f", mlx-lm {peer_step * 1e3:.3f} ms")
        + f", peer/ours {_ratio(peer_step, ours_step)}"
    )


def _layer_table(args: argparse.Namespace) -> None:
    dims = DeltaNetDims(
        hidden_size=args.hidden,
        num_k_heads=args.k_heads,
        num_v_heads=args.v_heads,
        head_k_dim=args.head_dim,
        head_v_dim=args.head_dim,
        conv_kernel=4,
        norm_eps=1e-6,
    )
    layer = GatedDeltaNet(dims)
    mx.eval(layer.parameters())
    x = mx.random.normal((1, args.tokens, args.hidden)) * 0.1
    mx.eval(x)
    print(f"whole GatedDeltaNet layer, prefill {args.tokens} tokens (hidden {args.hidden}):")
    for chunk in args.chunks:
        layer.chunk = chunk

        def run() -> None:
            cache = RecurrentCache()
            mx.eval(layer(x, cache), *cache.state)

        print(f"  chunk {chunk:<4} {_seconds(run, args.repeats):8.3f} s")


def _ratio(peer: float | None, ours: float) -> str:
    return "n/a" if peer is None else f"{peer / ours:6.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", default="16,32,64,128")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--k-heads", type=int, default=16)
    parser.add_argument("--v-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.chunks = [int(c) for c in args.chunks.split(",")]
    print(f"device: {mx.default_device()}")
    _rule_table(args)
    _layer_table(args)


if __name__ == "__main__":
    main()
