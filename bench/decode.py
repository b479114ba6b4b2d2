"""Prefill and decode speed of the gateway against mlx-lm, measured in the same run.

For each model three configurations run, each in its own process:
  gateway      our engine (runtime.engine.runner via runtime.engine.engine), float32, optimized BLAS
  mlx-lm f32   mlx_lm.generate_step on the *same* float32 weights, same BLAS preloaded
  mlx-lm bf16  mlx-lm as a user runs it out of the box: bf16 weights, stock MLX wheel
and a BLAS probe times the model's own matmul shapes, to say how close prefill gets
to what the BLAS can do.

    python bench/decode.py [--models smollm2-135m qwen2.5-coder-0.5b]
                           [--prompt-tokens 512] [--gen-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------- workers
def _prompt_ids(vocab: int, n: int) -> list[int]:
    # deterministic, spread over the vocabulary, avoiding the special ids at the ends
    return [(1009 * i + 7) % (vocab - 512) + 256 for i in range(n)]


def _vocab(config: dict[str, Any]) -> int:
    """The vocabulary size, also of a multimodal config that nests its text model's."""
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def _export_hf(gguf: Path, out: Path, dtype: str) -> None:
    """Write our loader's dequantized weights as a HF-style folder mlx-lm can load."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runtime.load import load

    loaded = load(gguf)
    flat: list[tuple[str, mx.array]] = tree_flatten(loaded.model.parameters())  # type: ignore[assignment]
    weights = {k: v.astype(getattr(mx, dtype)) for k, v in flat}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = dict(loaded.config)
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=1))


def worker_gateway(gguf: Path, prompt_tokens: int, gen_tokens: int, repeats: int) -> dict[str, Any]:
    import dataclasses

    from runtime.engine import Engine, ModelRunner
    from runtime.load import load
    from runtime.types import Finished, GenerationRequest, SamplingParams

    loaded = load(gguf)
    loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())  # always generate gen_tokens
    engine = Engine(ModelRunner(loaded))
    engine.start()
    vocab = _vocab(loaded.config)
    greedy = SamplingParams(temperature=0.0)
    warmup = GenerationRequest(tuple(_prompt_ids(vocab, 32)[::-1]), 8, greedy)
    list(engine.submit(warmup))
    runs = []
    for i in range(repeats):
        # a distinct first token each run, so the prefix cache cannot help
        prompt = (_prompt_ids(vocab, 1 + i)[-1] + 1, *_prompt_ids(vocab, prompt_tokens - 1))
        events = list(engine.submit(GenerationRequest(prompt, gen_tokens, greedy)))
        done = events[-1]
        assert isinstance(done, Finished), done
        assert done.stats.cached_tokens == 0, done.stats
        runs.append((done.stats.prefill_tps, done.stats.decode_tps, done.stats.peak_memory_bytes))
    engine.stop()
    return _best(runs)


def worker_mlxlm(folder: Path, prompt_tokens: int, gen_tokens: int, repeats: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, config = load_model(folder)
    vocab = _vocab(config)
    prompt = mx.array(_prompt_ids(vocab, prompt_tokens))
    for _ in generate_step(mx.array(_prompt_ids(vocab, 32)), model, max_tokens=8):
        pass  # warm up
    runs = []
    for _ in range(repeats):
        mx.reset_peak_memory()
        start = time.perf_counter()
        first = 0.0
        n = 0
        for n, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=gen_tokens), 1):
            if n == 1:
                _ = int(tok)
                first = time.perf_counter()
        end = time.perf_counter()
        runs.append(
            (prompt_tokens / (first - start), (n - 1) / (end - first), mx.get_peak_memory())
        )
    return _best(runs)


def worker_blas(gguf: Path, prompt_tokens: int) -> dict[str, Any]:
    """Time the model's matmuls at prefill shape alone: the BLAS's ceiling for prefill."""
    import mlx.core as mx

    from runtime.load import load

    loaded = load(gguf)
    cfg = loaded.config
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = (
        cfg["num_attention_heads"],
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
    )
    hd = cfg.get("head_dim") or h // heads
    shapes = [
        (h, heads * hd),
        (h, kv * hd),
        (h, kv * hd),
        (heads * hd, h),
        (h, inter),
        (h, inter),
        (inter, h),
    ]
    x = {k: mx.random.normal((prompt_tokens, k)) for k, _ in shapes}
    ws = [mx.random.normal((k, n)) for k, n in shapes]
    mx.eval(list(x.values()), ws)
    flops = sum(2 * prompt_tokens * k * n for k, n in shapes) * layers

    def once() -> None:
        mx.eval([x[k] @ w for (k, _), w in zip(shapes, ws, strict=True)])

    once()
    start = time.perf_counter()
    reps = 3
    for _ in range(reps * layers):
        once()
    per_layer = (time.perf_counter() - start) / (reps * layers)
    return {
        "blas_prefill_tps": prompt_tokens / (per_layer * layers),
        "gflops": flops / (per_layer * layers) / 1e9,
    }


def _best(runs: list[tuple[float, float, int]]) -> dict[str, Any]:
    return {
        "prefill_tps": max(r[0] for r in runs),
        "decode_tps": max(r[1] for r in runs),
        "peak_gb": max(r[2] for r in runs) / 1e9,
    }


# ---------------------------------------------------------------- driver
def _run_worker(args: list[str], *, blas: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if not blas:
        env["MLX_GATEWAY_BLAS"] = "none"
    cmd = [sys.executable, __file__, "--worker", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"worker {args} failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _worker_main(argv: list[str]) -> None:
    kind, path = argv[0], Path(argv[1])
    from runtime import backend

    backend.configure()
    if kind == "export":
        _export_hf(path, Path(argv[2]), argv[3])
        print("{}")
        return
    n_prompt, n_gen, repeats = (int(a) for a in argv[2:5])
    if kind == "gateway":
        result = worker_gateway(path, n_prompt, n_gen, repeats)
    elif kind == "mlxlm":
        result = worker_mlxlm(path, n_prompt, n_gen, repeats)
    else:
        result = worker_blas(path, n_prompt)
    print(json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker_main(sys.argv[2:])
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--stock-repeats", type=int, default=1, help="runs of the (slow) out-of-the-box mlx-lm"
    )
    args = p.parse_args()

    from gateway.cli.store.store import Store, gateway_home

    rows = []
    for alias in args.models:
        gguf = Store().resolve(alias)
        common = [str(args.prompt_tokens), str(args.gen_tokens), str(args.repeats)]
        folders = {}
        for dtype in ("float32", "bfloat16"):
            folder = gateway_home() / "bench" / f"{alias}-{dtype}"
            if not (folder / "model.safetensors").exists():
                _run_worker(["export", str(gguf), str(folder), dtype], blas=True)
            folders[dtype] = folder
        gw = _run_worker(["gateway", str(gguf), *common], blas=True)
        f32 = _run_worker(["mlxlm", str(folders["float32"]), *common], blas=True)
        stock = [str(args.prompt_tokens), str(args.gen_tokens), str(args.stock_repeats)]
        bf16 = _run_worker(["mlxlm", str(folders["bfloat16"]), *stock], blas=False)
        ceil = _run_worker(["blas", str(gguf), *common], blas=True)
        rows.append((alias, gw, f32, bf16, ceil))
    _print_table(rows, args)


def _print_table(rows: list[tuple[str, Any, Any, Any, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nprompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, greedy, best of {args.repeats}"
    )
    print("| model | run | prefill tok/s | decode tok/s | peak GB |")
    print("|---|---|---:|---:|---:|")
    for alias, gw, f32, bf16, ceil in rows:
        for name, r in (
            ("gateway f32+BLAS", gw),
            ("mlx-lm f32+BLAS", f32),
            ("mlx-lm bf16 stock", bf16),
        ):
            print(
                f"| {alias} | {name} | {r['prefill_tps']:.1f} | {r['decode_tps']:.1f} | {r['peak_gb']:.2f} |"
            )
        print(f"| {alias} | BLAS matmuls only | {ceil['blas_prefill_tps']:.1f} | | |")
    print(
        "\n| model | decode vs mlx-lm same weights (>=1.0) | decode vs mlx-lm out of box (>=2.5) | prefill vs BLAS ceiling (<=3x) |"
    )
    print("|---|---:|---:|---:|")
    for alias, gw, f32, bf16, ceil in rows:
        print(
            f"| {alias} | {gw['decode_tps'] / f32['decode_tps']:.2f}x | {gw['decode_tps'] / bf16['decode_tps']:.2f}x "
            f"| {ceil['blas_prefill_tps'] / gw['prefill_tps']:.2f}x slower |"
        )


if __name__ == "__main__":
    main()
