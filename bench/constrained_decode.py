"""Constrained against unconstrained decode speed, in the same run on the same weights.

For each model, the same prompt is decoded greedily without a grammar (EOS ignored,
so it runs the full budget) and under each grammar: three JSON schemas and a forced
hermes tool call over the opencode client's ten tools. Decode speed is tokens after
the first over the time from the first token to the last (prefill excluded), the
best of `--repeats` alternating runs (the machine is shared: slower runs measure the
neighbours); the ratio constrained / free is printed
(the issue's target is >= 0.9x). Runs go through runtime.batch.generate directly, so what
differs is only the grammar work: the mask computed on the CPU while the device runs
the next forward, and the masked sampling.

Then, unless `--batch 0`, the same grammars in the engine's running batch: `--batch`
concurrent requests through a real Engine, all constrained against all free, the
batch's aggregate decode rate over its steady part (bench/_batched_constrained.py), so
that the masks of several rows, computed on the CPU one row after another while the
device runs the step, are counted too.

    python bench/constrained_decode.py [--models tiny smollm2-135m qwen2.5-coder-0.5b]
                                       [--tokens 128] [--repeats 3] [--batch 4]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime import backend  # noqa: E402

backend.configure()

from bench._batched_constrained import BatchCase, bench_batched, schema_check, tool_check  # noqa: E402
from runtime.batch import generate_tokens  # noqa: E402
from runtime.load import LoadedModel, load  # noqa: E402
from runtime.text import (  # noqa: E402
    GrammarVocabulary,
    Sampler,
    TokenMatcher,
    json_schema_constraint,
)
from runtime.types import Constraint, SamplingParams  # noqa: E402

PROMPT = (
    "Describe three fictional people as JSON: each with a name, an age, a long biography "
    "and a list of hobbies. Be thorough."
)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "biography": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 3},
    },
    "required": ["name", "age", "biography", "hobbies"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict[str, Any]] = {
    "people array": {"type": "array", "items": PERSON, "minItems": 3},
    "enum records": {
        "type": "array",
        "minItems": 20,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "level": {"enum": ["low", "medium", "high", "critical"]},
                "note": {"type": "string"},
            },
            "required": ["id", "level", "note"],
            "additionalProperties": False,
        },
    },
    "string lines": {
        "type": "object",
        "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
        "required": ["lines"],
        "additionalProperties": False,
    },
}


def _model(name: str, scratch: Path) -> LoadedModel:
    if name == "tiny":
        from tests.support.agent_model import build_tiny_qwen3
        from tests.support.fixtures_real import npm_tokenizer_dir

        return load(build_tiny_qwen3(npm_tokenizer_dir("qwen3"), scratch / "tiny"))
    from gateway.cli.store.store import Store

    return load(Store().resolve(name))


def _tool_constraint(loaded: LoadedModel) -> tuple[Constraint, str, list[dict[str, Any]]]:
    """The forced hermes call over the opencode capture's tools, its opener, the tools."""
    from gateway.core.structured import marker_tag
    from parsers.grammars import call_grammar
    from tests.support.schema_cases import client_tool_schemas

    tools = [
        {"type": "function", "function": {"name": n.split(":")[1], "parameters": s}}
        for n, s in client_tool_schemas().items()
        if n.startswith("opencode_first_request_chat:")
    ]
    if not tools:
        raise SystemExit(
            "no captured opencode request: set MLX_GATEWAY_CLIENT_FIXTURES to the folder "
            "of client captures (../shared/fixtures/clients)"
        )
    grammar = call_grammar("hermes", tools, tag=marker_tag(loaded.tokenizer))
    if grammar is None:
        raise SystemExit("the opencode capture's tools give no hermes call grammar")
    return Constraint(grammar.after_opener, name="tools"), grammar.opener, tools


def _prompt(loaded: LoadedModel, suffix: str = "", note: str = "") -> list[int]:
    tok = loaded.tokenizer
    text = f"<|im_start|>user\n{PROMPT}{note}<|im_end|>\n<|im_start|>assistant\n{suffix}"
    return tok.encode_prompt(text)


def _decode(
    loaded: LoadedModel, prompt: list[int], matcher: TokenMatcher | None, budget: int
) -> tuple[int, float]:
    """(tokens, decode seconds after the first token); stops at EOS when constrained
    (a finished grammar allows nothing else)."""
    sampler = Sampler(SamplingParams(temperature=0.0), loaded.model.args.vocab_size, prompt)
    caches = loaded.model.make_caches()
    n, first = 0, 0.0
    for sampled in generate_tokens(
        loaded.model, caches, prompt, sampler, max_tokens=budget, constraint=matcher
    ):
        n += 1
        if n == 1:
            first = time.perf_counter()
        if matcher is not None and sampled.token_id in loaded.eos_token_ids:
            break
    return n, time.perf_counter() - first


def _batch_cases(
    loaded: LoadedModel, tool: Constraint, opener: str, tools: list[dict[str, Any]], rows: int
) -> list[BatchCase]:
    """The same grammars for the batched part, each row's prompt numbered apart."""
    notes = [f" (request {i + 1})" for i in range(rows)]
    cases = [
        BatchCase(
            name,
            json_schema_constraint(schema),
            [_prompt(loaded, note=n) for n in notes],
            schema_check(schema),
        )
        for name, schema in SCHEMAS.items()
    ]
    prompts = [_prompt(loaded, opener, n) for n in notes]
    return [*cases, BatchCase("forced tool call", tool, prompts, tool_check(tools, opener))]


def _tps(runs: list[tuple[int, float]]) -> float:
    """The best run: on a shared machine the others measure the neighbours."""
    return max((n - 1) / dt for n, dt in runs if n > 1 and dt > 0)


def bench_model(name: str, budget: int, repeats: int, batch: int, scratch: Path) -> None:
    loaded = _model(name, scratch)
    t0 = time.perf_counter()
    vocab = GrammarVocabulary(
        loaded.tokenizer.hf.to_str(), loaded.model.args.vocab_size, loaded.eos_token_ids
    )
    print(f"\n== {name}: vocabulary import {time.perf_counter() - t0:.2f} s")
    constraints = {k: json_schema_constraint(s) for k, s in SCHEMAS.items()}
    prompts = {k: _prompt(loaded) for k in SCHEMAS}
    tool, opener, tools = _tool_constraint(loaded)
    constraints["forced tool call"], prompts["forced tool call"] = tool, _prompt(loaded, opener)
    cases: dict[str, tuple[Callable[[], TokenMatcher], list[int]]] = {
        k: (functools.partial(vocab.matcher, c), prompts[k]) for k, c in constraints.items()
    }
    _decode(loaded, _prompt(loaded), None, 8)  # warm up
    print(f"{'case':<18}{'tokens':>7}{'free tok/s':>12}{'constrained tok/s':>19}{'ratio':>8}")
    for case, (make, prompt) in cases.items():
        free: list[tuple[int, float]] = []
        held: list[tuple[int, float]] = []
        for _ in range(repeats):
            free.append(_decode(loaded, prompt, None, budget))
            held.append(_decode(loaded, prompt, make(), budget))
        a, b = _tps(free), _tps(held)
        tokens = int(statistics.median(n for n, _ in held))
        print(f"{case:<18}{tokens:>7}{a:>12.1f}{b:>19.1f}{b / a:>7.2f}x")
    if batch > 0:
        batch_cases = _batch_cases(loaded, tool, opener, tools, batch)
        bench_batched(loaded, batch_cases, budget, repeats, batch)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--batch", type=int, default=4, help="concurrent requests through the engine; 0 = skip"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            bench_model(name, args.tokens, args.repeats, args.batch, Path(scratch))


if __name__ == "__main__":
    main()
