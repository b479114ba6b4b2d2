"""What `--kv-bits` costs in quality and buys in speed, on a real model (not a timed test).

For KV caches of none (float), 8 and 4 bits, in one process on the same weights:

- greedy agreement with the float cache: generated tokens until the first divergence,
  and the share of positions holding the same token, over `--gen` tokens of a few
  prompts (code and prose);
- perplexity over `--ppl-tokens` tokens of a long text (Python sources of the standard
  library: any machine has them), read in chunks of 512 as a server reads a prompt, and
  how often the most likely next token is the float cache's;
- each against a noise floor: the float cache computed in another order (greedy: every
  C kernel off; perplexity: MLX's attention in place of the C kernel's), which no one
  would call lossy;
- decode tokens/s after a `--context`-token prompt (none and 8 bits; CPU: the 8-bit
  cache read by the C kernel, and by MLX's ops for comparison), alternating the
  configurations so that a busy machine slows them alike.

    python bench/kv_bits.py [--model ~/.cache/mlx-gateway/models/qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = (
    'def quicksort(xs):\n    """Sort a list of numbers."""\n',
    "# A command line tool that counts words in files\nimport argparse\n",
    "The history of the printing press begins in",
    "<|im_start|>user\nExplain what a hash map is and write one in C.<|im_end|>\n"
    "<|im_start|>assistant\n",
)


def _model_file(path: Path) -> Path:
    return next(iter(sorted(path.glob("*.gguf")))) if path.is_dir() else path


def _caches(model: Any, bits: int | None) -> list[Any]:
    # imported on use: mlx only after backend.configure() has loaded the BLAS
    from runtime.cache import quantizing

    return quantizing(model.make_caches, bits)()


def greedy(model: Any, prompt: list[int], bits: int | None, n: int) -> list[int]:
    # imported on use: mlx only after backend.configure() has loaded the BLAS
    import mlx.core as mx

    from runtime.batch.generate import prefill

    caches = _caches(model, bits)
    rest = prefill(model, caches, prompt, chunk=512)
    tokens = mx.array(rest, dtype=mx.int32)[None]
    out: list[int] = []
    for _ in range(n):
        logits = model.logits(model.forward(tokens, caches)[:, -1, :])
        token = cast(int, mx.argmax(logits, axis=-1).item())
        out.append(token)
        tokens = mx.array([[token]], dtype=mx.int32)
    return out


def perplexity(
    model: Any, ids: list[int], bits: int | None, chunk: int = 512
) -> tuple[float, list[int]]:
    """Perplexity of `ids`, and the most likely next token at every position."""
    # imported on use: mlx only after backend.configure() has loaded the BLAS
    import mlx.core as mx

    caches = _caches(model, bits)
    nll, count = 0.0, 0
    best: list[int] = []
    for start in range(0, len(ids) - 1, chunk):
        part = ids[start : start + chunk + 1]
        inputs = mx.array(part[:-1], dtype=mx.int32)[None]
        logits = model.logits(model.forward(inputs, caches))[0].astype(mx.float32)
        targets = mx.array(part[1:], dtype=mx.int32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logp, targets[:, None], axis=-1)
        nll -= cast(float, mx.sum(picked).item())
        best += cast(list[int], mx.argmax(logits, axis=-1).tolist())
        count += len(part) - 1
        mx.clear_cache()
    return math.exp(nll / count), best


def decode_rate(model: Any, caches: list[Any], first: int, steps: int) -> float:
    """Tokens/s of `steps` greedy decode steps, pipelined as the server's loop is."""
    # imported on use: mlx only after backend.configure() has loaded the BLAS
    import mlx.core as mx

    token = mx.array([[first]], dtype=mx.int32)
    began = time.perf_counter()
    pending = None
    for _ in range(steps):
        logits = model.logits(model.forward(token, caches)[:, -1, :])
        token = mx.argmax(logits, axis=-1).reshape(1, 1).astype(mx.int32)
        mx.async_eval(token)
        if pending is not None:
            pending.item()
        pending = token
    assert pending is not None
    pending.item()
    return steps / (time.perf_counter() - began)


def agreement(refs: list[list[int]], runs: list[list[int]]) -> str:
    """Tokens until the first divergence from the reference, per prompt, and the share of
    positions holding the same token."""
    first = [
        next((i for i, (a, b) in enumerate(zip(r, g, strict=True)) if a != b), len(r))
        for r, g in zip(refs, runs, strict=True)
    ]
    same = sum(a == b for r, g in zip(refs, runs, strict=True) for a, b in zip(r, g, strict=True))
    total = sum(len(r) for r in refs)
    return f"first divergence {first}, tokens equal {100 * same / total:.1f}%"


def long_text(tokenizer: Any, tokens: int) -> list[int]:
    """`tokens` token ids of the standard library's Python sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in ("argparse.py", "inspect.py", "typing.py", "dataclasses.py", "pathlib.py"):
        ids += tokenizer.encode((lib / name).read_text(encoding="utf-8"))
        if len(ids) >= tokens:
            break
    return ids[:tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path.home() / ".cache/mlx-gateway/models/qwen2.5-coder-0.5b"
    parser.add_argument("--model", type=Path, default=default)
    parser.add_argument("--gen", type=int, default=256)
    parser.add_argument("--ppl-tokens", type=int, default=3072)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=(), choices=("greedy", "ppl", "speed"))
    args = parser.parse_args()
    faulthandler.dump_traceback_later(3600, exit=True)  # a hung run says where

    # imported here: backend.configure() loads the BLAS before anything imports mlx
    from runtime import backend

    backend.configure()
    # imported on use: mlx only after backend.configure() has loaded the BLAS
    import mlx.core as mx

    import runtime.kernels as kernels_pkg
    import runtime.models.quantized_attention as qa
    from runtime.batch.generate import prefill
    from runtime.kernels import ENV_SWITCH
    from runtime.load import load

    loaded = load(_model_file(args.model.expanduser()))
    model, tok = loaded.model, loaded.tokenizer
    print(f"model {loaded.source.name}, device {mx.default_device()}, dtype {loaded.dtype}")
    widths: tuple[int | None, ...] = (None, 8, 4)
    # compared with the float cache, after its noise floor: the float cache with MLX's ops
    # in place of the C kernels, the same maths summed in another order
    rows: list[tuple[str, int | None, bool]] = [("none, MLX ops", None, False)]
    rows += [(str(bits), bits, True) for bits in widths[1:]]

    if "greedy" not in args.skip:
        print(f"\ngreedy agreement with the float cache, {args.gen} tokens per prompt")
        refs = [greedy(model, tok.encode(text), None, args.gen) for text in PROMPTS]
        for label, bits, kernels in rows:
            os.environ[ENV_SWITCH] = "1" if kernels else "0"
            got = [greedy(model, tok.encode(text), bits, args.gen) for text in PROMPTS]
            os.environ[ENV_SWITCH] = "1"
            print(f"  kv {label}: {agreement(refs, got)}")

    if "ppl" not in args.skip:
        ids = long_text(tok, args.ppl_tokens)
        print(f"\nperplexity over {len(ids)} tokens of stdlib Python, and how often the")
        print("most likely next token is the float cache's (the same prefix at every position)")
        ppl, ref = perplexity(model, ids, None)
        print(f"  kv none: {ppl:.4f}")
        attend = kernels_pkg.attention
        for label, bits, kernels in rows:
            # the noise floor here: MLX's attention in place of the C kernel's (with every
            # kernel off, MLX's scalar quantized matmul would take an hour)
            label = label.replace("MLX ops", "MLX attention")
            kernels_pkg.attention = attend if kernels else lambda *_, **__: None
            ppl, tops = perplexity(model, ids, bits)
            kernels_pkg.attention = attend
            same = sum(a == b for a, b in zip(ref, tops, strict=True))
            print(f"  kv {label}: {ppl:.4f}, argmax equal {100 * same / len(ref):.2f}%")

    if "speed" not in args.skip:
        ids = long_text(tok, args.context)
        configs: dict[str, tuple[int | None, bool]] = {
            "none": (None, True),
            "8 (kernel)": (8, True),
            "8 (mlx ops)": (8, False),
        }
        states = {}
        for name, (bits, _) in configs.items():
            caches = _caches(model, bits)
            rest = prefill(model, caches, ids, chunk=2048)
            states[name] = (caches, rest[-1])
            mx.clear_cache()
        nbytes = {n: sum(c.nbytes for c in s[0]) for n, s in states.items()}
        rates: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (_, kernel) in configs.items():
                caches, start = states[name]
                qa.DECODE_KERNEL = kernel
                rates[name].append(decode_rate(model, caches, start, args.steps))
                for c in caches:
                    c.trim(args.steps)
        qa.DECODE_KERNEL = True
        print(f"\ndecode after {len(ids)} tokens, {args.steps} steps x {args.rounds} rounds")
        for name, seen in rates.items():
            best = max(seen)
            print(
                f"  kv {name}: {best:.2f} tok/s (rounds {', '.join(f'{r:.2f}' for r in seen)}),"
                f" cache {nbytes[name] / 1e6:.0f} MB"
            )


if __name__ == "__main__":
    main()
