"""Grammar-constrained decoding (runtime/text/constraints.py, the constrained decode loop):
a tiny random Qwen3, whose free output is noise, writes documents the `jsonschema`
package accepts for every schema of the test set and every tool schema of the real
clients' captures; forced tool calls parse to declared tools with valid arguments.

Schemas are given to the model in their `bounded` form (short strings and arrays, so a
near-uniform draw ends within a few hundred tokens); documents are checked against the
original schema, which the bounded one only narrows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from gateway.core.structured import marker_tag
from parsers.grammars import call_grammar, free_calls
from runtime.batch.generate import generate_tokens
from runtime.load.loaded import LoadedModel
from runtime.load.loader import load
from runtime.text.constraints import (
    ConstraintError,
    GrammarVocabulary,
    TokenMatcher,
    check,
    json_schema_constraint,
    lark_constraint,
)
from runtime.text.sampling import Sampler
from runtime.types import Constraint, ReasoningBudget, SamplingParams
from tests.support.schema_cases import (
    SCHEMAS,
    bounded,
    client_lark_grammars,
    client_tool_schemas,
    hermes_calls,
)

PROMPT = "<|im_start|>user\nAnswer in JSON.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 400
TOOL_SCHEMAS = client_tool_schemas()


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_dir: Path) -> LoadedModel:
    return load(tiny_qwen3_dir)


@pytest.fixture(scope="module")
def hf(loaded: LoadedModel) -> Any:
    return loaded.tokenizer.hf


@pytest.fixture(scope="module")
def tag(loaded: LoadedModel) -> Callable[[str], str]:
    return marker_tag(loaded.tokenizer)


@pytest.fixture(scope="module")
def vocab(loaded: LoadedModel) -> GrammarVocabulary:
    tok = loaded.tokenizer
    return GrammarVocabulary(tok.hf.to_str(), loaded.model.args.vocab_size, loaded.eos_token_ids)


def _generate(
    loaded: LoadedModel,
    matcher: TokenMatcher | None,
    *,
    seed: int = 0,
    params: SamplingParams | None = None,
    prompt: str = PROMPT,
    max_tokens: int = MAX_TOKENS,
) -> tuple[list[int], bool]:
    """(tokens before EOS, whether EOS ended them)."""
    ids = loaded.tokenizer.encode(prompt)
    params = params or SamplingParams(temperature=1.0, seed=seed)
    sampler = Sampler(params, loaded.model.args.vocab_size, ids)
    out: list[int] = []
    caches = loaded.model.make_caches()
    for sampled in generate_tokens(
        loaded.model, caches, ids, sampler, max_tokens=max_tokens, constraint=matcher
    ):
        if sampled.token_id in loaded.eos_token_ids:
            return out, True
        out.append(sampled.token_id)
    return out, False


def _document(loaded: LoadedModel, vocab: GrammarVocabulary, schema: Any, seed: int) -> Any:
    tokens, ended = _generate(
        loaded, vocab.matcher(json_schema_constraint(bounded(schema))), seed=seed
    )
    text = loaded.tokenizer.decode(tokens, skip_special_tokens=False)
    assert ended, f"no EOS within {MAX_TOKENS} tokens: {text[:200]!r}"
    return json.loads(text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_documents_validate(loaded: LoadedModel, vocab: GrammarVocabulary, name: str) -> None:
    schema = SCHEMAS[name]
    for seed in range(2):
        jsonschema.validate(_document(loaded, vocab, schema, seed), schema)


@pytest.mark.skipif(not TOOL_SCHEMAS, reason="no captured client requests")
def test_client_tool_schemas_validate(loaded: LoadedModel, vocab: GrammarVocabulary) -> None:
    """Every distinct tool parameter schema of the captured clients (59 of them)."""
    assert len(TOOL_SCHEMAS) >= 40
    for i, (name, schema) in enumerate(sorted(TOOL_SCHEMAS.items())):
        # the engine leaves propertyNames and the like unenforced; the rest must hold
        constraint = json_schema_constraint(bounded(schema), lenient=True)
        tokens, ended = _generate(loaded, vocab.matcher(constraint), seed=i)
        text = loaded.tokenizer.decode(tokens, skip_special_tokens=False)
        assert ended, f"{name}: no EOS: {text[:200]!r}"
        jsonschema.validate(json.loads(text), schema)


def test_unconstrained_output_is_noise(loaded: LoadedModel) -> None:
    """The baseline the tests above stand on: free, the model writes no JSON."""
    tokens, _ = _generate(loaded, None, max_tokens=40)
    text = loaded.tokenizer.decode(tokens, skip_special_tokens=False)
    with pytest.raises(ValueError):
        json.loads(text)


def test_mask_allows_eos_only_when_the_document_is_complete(
    vocab: GrammarVocabulary, hf: Any
) -> None:
    tok_ids = vocab.eos_ids
    matcher = vocab.matcher(json_schema_constraint({"type": "array", "items": {"type": "integer"}}))
    tokenizer = hf
    for piece in ("[", "1", ", ", "2"):
        allowed = matcher.allowed()
        assert allowed.shape == (vocab.vocab_size,) and allowed.dtype == np.bool_
        assert not allowed[list(tok_ids)].any()
        for token in tokenizer.encode(piece, add_special_tokens=False).ids:
            matcher.advance(token)
    matcher.advance(tokenizer.token_to_id("]"))
    assert matcher.accepting and matcher.finished
    assert set(np.flatnonzero(matcher.allowed()).tolist()) == set(tok_ids)


def test_a_refused_token_is_an_error(vocab: GrammarVocabulary, hf: Any) -> None:
    matcher = vocab.matcher(json_schema_constraint({"type": "object"}))
    with pytest.raises(ConstraintError, match="breaks the grammar"):
        matcher.advance(hf.token_to_id("hello"))


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
        ({"type": "array", "unevaluatedItems": False}, "unevaluatedItems"),
    ],
)
def test_unsupported_keyword_is_named(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(ConstraintError) as err:
        check(json_schema_constraint(schema))
    assert keyword in str(err.value) and err.value.keywords == (keyword,)
    check(json_schema_constraint(schema, lenient=True))  # leniently, the rest is enforced


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "strng"}, "strng"),
    ],
)
def test_broken_schemas_say_why(schema: dict[str, Any], words: str) -> None:
    with pytest.raises(ConstraintError, match=words) as err:
        check(json_schema_constraint(schema))
    assert "\n" not in str(err.value)  # one line, without the engine's grammar dump


def test_all_tokens_allowed_gives_the_unconstrained_tokens(
    loaded: LoadedModel, vocab: GrammarVocabulary
) -> None:
    """The constrained loop (forward queued ahead, mask between) samples exactly what
    the free loop does when the grammar allows every token."""
    greedy = SamplingParams(temperature=0.0)
    free, _ = _generate(loaded, None, params=greedy, max_tokens=24)
    anything = vocab.matcher(lark_constraint("start: <[*]>*"))
    constrained, _ = _generate(loaded, anything, params=greedy, max_tokens=24)
    assert constrained == free
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    assert _generate(
        loaded, vocab.matcher(lark_constraint("start: <[*]>*")), params=seeded, max_tokens=24
    ) == _generate(loaded, None, params=seeded, max_tokens=24)


def test_reasoning_stays_free_until_the_block_closes(
    loaded: LoadedModel, vocab: GrammarVocabulary
) -> None:
    """The prompt leaves the model inside <think>: the grammar starts at </think>. The
    random model never closes the block by itself; a reasoning budget forces it."""
    schema = SCHEMAS["enum_const"]
    close = loaded.tokenizer.token_to_id("</think>")
    assert close is not None
    budget = ReasoningBudget(tokens=6, close_id=close, inside=True)
    params = SamplingParams(temperature=1.0, seed=3, reasoning_budget=budget)
    constraint = replace(json_schema_constraint(schema), reasoning="open")
    tokens, ended = _generate(
        loaded, vocab.matcher(constraint), params=params, prompt=PROMPT + "<think>\n"
    )
    assert ended and tokens.index(close) == 6
    answer = loaded.tokenizer.decode(tokens[7:], skip_special_tokens=False)
    jsonschema.validate(json.loads(answer), schema)


def test_optional_reasoning_block(vocab: GrammarVocabulary, hf: Any) -> None:
    """With "optional", the output either opens a think block or is the answer."""
    tok = hf
    constraint = replace(json_schema_constraint({"const": 1}), reasoning="optional")
    for text in ("<think>\nhmm</think>\n\n1", "1"):
        matcher = vocab.matcher(constraint)
        for token in tok.encode(text, add_special_tokens=False).ids:
            matcher.advance(token)
        assert matcher.accepting


@pytest.mark.skipif(not client_lark_grammars(), reason="no captured custom tool grammar")
def test_codex_apply_patch_grammar(vocab: GrammarVocabulary, hf: Any) -> None:
    """A client's own Lark grammar (Codex's apply_patch tool) compiles and takes a patch."""
    grammar = next(iter(client_lark_grammars().values()))
    constraint = lark_constraint(grammar, name="apply_patch")
    check(constraint)
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch\n"
    matcher = vocab.matcher(constraint)
    for token in hf.encode(patch, add_special_tokens=False).ids:
        matcher.advance(token)
    assert matcher.accepting


def _openai_tools(names: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(declared tools, the same with bounded schemas for the random model)."""
    declared = [
        {"type": "function", "function": {"name": n.split(":")[1], "parameters": TOOL_SCHEMAS[n]}}
        for n in names
    ]
    small = [
        {
            "type": "function",
            "function": {"name": n.split(":")[1], "parameters": bounded(TOOL_SCHEMAS[n])},
        }
        for n in names
    ]
    return declared, small


@pytest.mark.skipif(not TOOL_SCHEMAS, reason="no captured client requests")
@pytest.mark.parametrize("parallel", [False, True])
def test_forced_hermes_call_names_a_declared_tool(
    loaded: LoadedModel, vocab: GrammarVocabulary, tag: Callable[[str], str], parallel: bool
) -> None:
    names = sorted(n for n in TOOL_SCHEMAS if n.startswith("opencode_first_request_chat:"))
    declared, small = _openai_tools(names)
    grammar = call_grammar("hermes", small, tag=tag, parallel=parallel)
    assert grammar is not None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in declared}
    for seed in range(3):
        constraint = Constraint(grammar.after_opener, name="tools")
        tokens, ended = _generate(
            loaded, vocab.matcher(constraint), seed=seed, prompt=PROMPT + grammar.opener
        )
        assert ended
        text = grammar.opener + loaded.tokenizer.decode(tokens, skip_special_tokens=False)
        calls = hermes_calls(text, declared)
        assert calls and (parallel or len(calls) == 1)
        for name, args in calls:
            jsonschema.validate(json.loads(args), schemas[name])


def test_call_grammar_names_only_declared_tools(
    vocab: GrammarVocabulary, hf: Any, tag: Callable[[str], str]
) -> None:
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object"}}},
    ]
    both = call_grammar("hermes", tools, tag=tag)
    assert both is not None and both.opener.endswith('{"name": "')
    allowed = vocab.matcher(Constraint(both.after_opener)).allowed()
    assert allowed[hf.token_to_id("a")] and allowed[hf.token_to_id("b")]
    assert not allowed[hf.token_to_id("c")]
    # one candidate: the opener names it, the grammar starts at its arguments
    named = call_grammar("hermes", tools, tag=tag, only=["b"])
    assert named is not None and named.opener.endswith('{"name": "b", "arguments":')
    allowed = vocab.matcher(Constraint(named.after_opener)).allowed()
    (space_brace,) = hf.encode(" {", add_special_tokens=False).ids
    assert allowed[space_brace] and not allowed[hf.token_to_id("{")]
    assert call_grammar("think", tools, tag=tag) is None  # a parser with no call format


def test_mask_is_as_wide_as_the_logits(loaded: LoadedModel, vocab: GrammarVocabulary) -> None:
    """The model's embedding may be wider than the tokenizer (Qwen pads to 151936):
    the extra ids are never allowed."""
    assert vocab.vocab_size == loaded.model.args.vocab_size
    mask = vocab.matcher(json_schema_constraint({"type": "string"})).mask()
    assert mask.shape == (vocab.vocab_size,) and mask.dtype == mx.bool_


def test_formats_without_a_grammar_keep_calls_possible(
    vocab: GrammarVocabulary, hf: Any, tag: Callable[[str], str]
) -> None:
    """Next to a response format, a format whose grammar can carry none of the tools
    (free_calls is the fallback then) may still open a call; what follows the opener
    is left free."""
    rules = free_calls("qwen3-coder", tag=tag)
    assert rules is not None and free_calls("think", tag=tag) is None
    answer = json_schema_constraint({"const": 1})
    constraint = Constraint(f"start: @answer | calls\n{rules}", (("answer", answer.grammar),))
    check(constraint)
    call = "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    for text in (call, "1"):
        matcher = vocab.matcher(constraint)
        for token in hf.encode(text, add_special_tokens=False).ids:
            matcher.advance(token)
        assert matcher.accepting
