"""Greedy agreement with llama.cpp on the real GGUFs: the oracle for the CPU's quantized
path (issue 26: it must agree with llama.cpp for at least as many tokens as the float32
path does).

For each model and chat prompt, the same prompt token ids go to llama.cpp
(llama-cpp-python, greedy) and to our model four ways: dequantized to float32 (the float
path), and quantized with decode rows in float32, int16 (the default) and int8
(MLX_GATEWAY_CPU_ACTIVATIONS). Printed: how many leading tokens of each
equal llama.cpp's, and of how many generated.

    python bench/greedy_agreement.py [--tokens 64] [--models smollm2-135m ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime import backend  # noqa: E402

backend.configure()

import mlx.core as mx  # noqa: E402

from gateway.core.models.build import model_controls  # noqa: E402
from runtime.kernels import primitives  # noqa: E402
from runtime.load import load  # noqa: E402
from runtime.load.loaded import LoadedModel  # noqa: E402
from templates import render_prompt, renderer_for  # noqa: E402
from templates.types import Message, RenderOptions  # noqa: E402

MODELS = {
    "smollm2-135m": "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma3-270m": "gemma3-270m/gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Explain what a hash map is to a new programmer.",
    "List three uses of the Rust borrow checker.",
)


def _prompt(loaded: LoadedModel, text: str) -> list[int]:
    tok = loaded.tokenizer
    if not loaded.chat_template:  # a base model: the text itself
        return tok.encode_prompt(text)
    renderer = renderer_for(
        loaded.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token,
        model_type=str(loaded.config.get("model_type")),
    )  # fmt: skip
    # as the server renders and tokenizes a request (content spans read as text)
    rendered = render_prompt(
        renderer, (Message("user", text),), (), RenderOptions(), model_controls(loaded)
    )
    return tok.encode_prompt(rendered.text, content=rendered.content)


def _greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    model, caches, out = loaded.model, loaded.model.make_caches(), []
    logits = model.logits(model.forward(mx.array([ids]), caches))[:, -1]
    for _ in range(n):
        token = int(mx.argmax(logits, axis=-1).item())
        out.append(token)
        logits = model.logits(model.forward(mx.array([[token]]), caches))[:, -1]
    return out


def _llama(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    import llama_cpp  # the peer, only here

    llm = llama_cpp.Llama(str(path), n_ctx=4096, n_threads=2, verbose=False)
    outs = []
    for ids in prompts:
        llm.reset()
        tokens = []
        for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if len(tokens) == n:
                break
        outs.append(tokens)
    return outs


def _same(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    cache = Path.home() / ".cache" / "mlx-gateway" / "models"
    print("| model | prompt | float32 | quantized, f32 rows | int16 rows | int8 rows |")
    print("|---|---|---:|---:|---:|---:|")
    totals = [0, 0, 0, 0]
    for name in args.models:
        path = cache / MODELS[name]
        floats, quantized = load(path, keep_quantized=False), load(path)
        prompts = [_prompt(floats, p) for p in PROMPTS]
        reference = _llama(path, prompts, args.tokens)
        for text, ids, ref in zip(PROMPTS, prompts, reference, strict=True):
            counts = [_same(_greedy(floats, ids, args.tokens), ref)]
            for activations in ("float32", "int16", "int8"):
                os.environ[primitives.ENV_ACTIVATIONS] = activations
                counts.append(_same(_greedy(quantized, ids, args.tokens), ref))
            totals = [t + c for t, c in zip(totals, counts, strict=True)]
            cells = " | ".join(f"{c}/{len(ref)}" for c in counts)
            print(f"| {name} | {text[:32]}… | {cells} |", flush=True)
    print("| **all** | | " + " | ".join(map(str, totals)) + " |")


if __name__ == "__main__":
    main()
