"""MLA's two forms (runtime/models/mla.py) against each other, on one attention layer.

The expanded form re-expands every cached latent into per-head keys and values, then runs
ordinary attention; the absorbed form folds kv_b_proj into the queries and outputs and
attends over the latents directly. Each is the other's peer: the script prints seconds
and the absorbed/expanded ratio for one-shot prefill, chunked prefill and decode, plus
the time with `use_absorbed` (the cost model the layer uses) choosing per call.

Default dimensions are DeepSeek-V2-Lite / Moonlight's (16 heads, kv_lora_rank 512,
qk 128 + 64, v 128, hidden 2048); `--heads 128 --hidden 7168` gives DeepSeek V3's layer.

    python bench/mla_prefill.py [--tokens 2048] [--chunks 512 128 32] [--heads 16] [--repeats 3]
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

from runtime.cache import LatentCache  # noqa: E402
from runtime.models.mla import (  # noqa: E402
    MLAConfig,
    MultiLatentAttention,
    make_rope,
    use_absorbed,
)
from runtime.models.rope import RopeSpec  # noqa: E402


def _layer(heads: int, hidden: int) -> MultiLatentAttention:
    cfg = MLAConfig(
        hidden_size=hidden,
        num_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        attention_bias=False,
        rope=RopeSpec(),
    )
    layer = MultiLatentAttention(cfg, make_rope(cfg))
    mx.eval(layer.parameters())
    return layer


def _prefill(layer: MultiLatentAttention, x: mx.array, chunk: int) -> Callable[[], None]:
    def run() -> None:
        cache = LatentCache()
        for start in range(0, x.shape[1], chunk):
            out = layer(x[:, start : start + chunk], cache)
            mx.eval(out, *cache.state)

    return run


def _decode(layer: MultiLatentAttention, x: mx.array, steps: int) -> Callable[[], None]:
    """`steps` single-token steps after a context of x's length (prefilled untimed)."""
    cache = LatentCache()
    saved = layer.absorb
    layer.absorb = None
    mx.eval(layer(x, cache), *cache.state)
    layer.absorb = saved
    context = cache.offset
    step = mx.random.normal((1, 1, x.shape[-1]))

    def run() -> None:
        cache.trim(cache.offset - context)
        for _ in range(steps):
            mx.eval(layer(step, cache), *cache.state)

    return run


def _time(
    layer: MultiLatentAttention, absorb: bool | None, run: Callable[[], None], repeats: int
) -> float:
    layer.absorb = absorb
    run()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    layer.absorb = None
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="*", default=[512, 128, 32])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    mx.random.seed(0)
    layer = _layer(args.heads, args.hidden)
    x = mx.random.normal((1, args.tokens, args.hidden))
    cases = [(f"prefill {args.tokens} one shot", _prefill(layer, x, args.tokens), args.tokens, 0)]
    for chunk in args.chunks:
        run = _prefill(layer, x, chunk)
        cases.append((f"prefill {args.tokens} in {chunk}s", run, chunk, args.tokens - chunk))
    steps = args.decode_steps
    cases.append((f"decode x{steps} at {args.tokens}", _decode(layer, x, steps), 1, args.tokens))
    print(
        f"MLA layer: {args.heads} heads, hidden {args.hidden}, rank 512, qk 128+64, v 128 "
        f"(device {mx.default_device()})"
    )
    print(f"{'case':30} {'expanded s':>11} {'absorbed s':>11} {'abs/exp':>8} {'auto s':>8}  picks")
    for name, run, length, context in cases:
        expanded = _time(layer, False, run, args.repeats)
        absorbed = _time(layer, True, run, args.repeats)
        auto = _time(layer, None, run, args.repeats)
        # auto: the cost model's pick per call; shown, its pick for the last call
        pick = "absorbed" if use_absorbed(layer.cfg, length, context + length) else "expanded"
        ratio = absorbed / expanded
        print(f"{name:30} {expanded:11.4f} {absorbed:11.4f} {ratio:8.2f} {auto:8.4f}  {pick}")


if __name__ == "__main__":
    main()
