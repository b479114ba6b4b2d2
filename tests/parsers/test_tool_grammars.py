"""Tool-call grammars of every format (parsers/grammars), judged by what matters: what
the format's own parser reads back.

A tiny random model (its free output is noise) forced to call always writes a call the
parser reads, to a declared tool, with arguments the `jsonschema` package accepts:
several seeds, several tool sets, the captured clients' among them. With tool_choice
auto, whatever it writes, each call it makes does too, and it is never made to call.
Each grammar also takes hand-written calls as the templates write them, refuses broken
ones, and leaves text around calls free.

Formats run with the vocabulary whose markers they are trained on where one is at
hand (hermes, qwen3-coder and glm with Qwen3's, where `<tool_call>` is one token;
deepseek with DeepSeek-V3's; llama3-json with Llama 3's), and deepseek also with
Qwen3's, where its markers are plain text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import parsers
from gateway.core.structured import marker_tag
from parsers.events import ToolCallArgs, ToolCallStart
from parsers.grammars import GRAMMAR_KEY, CallGrammar, call_grammar
from parsers.grammars.lark_regex import lark_to_regex
from runtime.load.loaded import LoadedModel
from runtime.load.loader import load
from runtime.text.constraints import ConstraintError, GrammarVocabulary, TokenMatcher
from runtime.text.tokenizer import Tokenizer
from runtime.types import Constraint
from tests.support.agent_model import build_tiny_qwen3
from tests.support.schema_cases import (
    TIME_TOOL_PARAMS,
    WEATHER_TOOL_PARAMS,
    bounded,
    client_lark_grammars,
    client_tool_schemas,
)

# format -> (vocabulary, the fixture of its tokenizer folder)
FORMATS: Mapping[str, str] = {
    "hermes": "qwen3",
    "qwen3-coder": "qwen3",
    "glm-4.7": "qwen3",
    "glm-4.5": "qwen3",
    "deepseek-v3.1": "deepseek_v3",
    "deepseek-v3": "deepseek_v3",
    "deepseek-text": "qwen3",  # deepseek-v3.1 where its markers are not tokens
    "llama3-json": "llama3",
}
TOKENIZER_FIXTURES = {
    "qwen3": "qwen3_tokenizer_dir",
    "deepseek_v3": "deepseek_v3_tokenizer_dir",
    "llama3": "llama3_tokenizer_dir",
}
MAX_TOKENS = 800
CLIENT_SCHEMAS = client_tool_schemas()

# -- tools --------------------------------------------------------------------------------

# every kind of value: typed scalars, JSON in an XML value, a string-or-null, an untyped
# enum (read back as a string), a reference
MIXED = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ratio": {"type": "number"},
        "on": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "meta": {
            "type": "object",
            "properties": {"k": {"type": "string", "maxLength": 3}},
            "required": ["k"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"], "maxLength": 5},
        "mode": {"enum": ["fast", "slow", 3]},
        "size": {"$ref": "#/$defs/size"},
    },
    "required": ["count", "on", "tags", "meta", "note", "mode", "size"],
    "additionalProperties": False,
    "$defs": {"size": {"type": "string", "enum": ["S", "M", "L"]}},
}
# a custom tool with its own (small, so a random model ends it) grammar
CALC_GRAMMAR = 'start: op " " NUM\nop: "add" | "sub"\nNUM: /[0-9]{1,3}/\n'


def _custom_input(definition: str) -> dict[str, Any]:
    """A custom tool's parameters: one string `input` that keeps to a Lark grammar."""
    grammar = {GRAMMAR_KEY: {"syntax": "lark", "definition": definition}}
    return {
        "type": "object",
        "properties": {"input": {"type": "string", **grammar}},
        "required": ["input"],
        "additionalProperties": False,
    }


CALC = _custom_input(CALC_GRAMMAR)
NOOP = {"type": "object", "properties": {}, "additionalProperties": False}


def _tool(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


SMALL = [
    _tool("get_weather", WEATHER_TOOL_PARAMS),
    _tool("get_time", TIME_TOOL_PARAMS),
    _tool("noop", NOOP),
]
TYPED = [_tool("configure", MIXED), _tool("calc", CALC)]


def _client_tools(capture: str) -> list[dict[str, Any]]:
    return [
        _tool(name.split(":", 1)[1], schema)
        for name, schema in sorted(CLIENT_SCHEMAS.items())
        if name.startswith(capture + ":")
    ]


TOOL_SETS: Mapping[str, Callable[[], list[dict[str, Any]]]] = {
    "small": lambda: SMALL,
    "typed": lambda: TYPED,
    "claude_code": lambda: _client_tools("claude_code_first_request"),
    "codex": lambda: _client_tools("codex_first_request"),
    "opencode": lambda: _client_tools("opencode_first_request_chat"),
}


def _bounded_tools(tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the random model sees them (see schema_cases.bounded), numbers
    bounded too: with a vocabulary of many-digit tokens a random draw never stops."""
    return [
        _tool(t["function"]["name"], _small_numbers(bounded(t["function"]["parameters"])))
        for t in tools
    ]


def _small_numbers(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_small_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _small_numbers(v) for k, v in schema.items()}
    given = out.get("type")
    kinds: list[Any] = given if isinstance(given, list) else [given]
    if {"integer", "number"} & set(kinds):
        out.setdefault("maximum", 999)
        out.setdefault("minimum", -999)
        if "number" in kinds:
            out.setdefault("multipleOf", 0.25)  # else the fraction's digits run on
    return out


# -- the model and its vocabulary ---------------------------------------------------------


@dataclass(frozen=True)
class Rig:
    loaded: LoadedModel
    vocab: GrammarVocabulary
    tag: Callable[[str], str]

    @property
    def hf(self) -> Any:
        return self.loaded.tokenizer.hf

    def ids(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def text(self, ids: Sequence[int]) -> str:
        return str(self.loaded.tokenizer.decode(list(ids), skip_special_tokens=False))


def _build_rig(tokenizer_dir: Path, out: Path) -> Rig:
    """The tiny random Qwen3 over another vocabulary: its ends of turn are the
    vocabulary's own."""
    build_tiny_qwen3(tokenizer_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = sorted(Tokenizer.from_folder(out).eos_token_ids)
    config.pop("bos_token_id", None)
    (out / "config.json").write_text(json.dumps(config))
    loaded = load(out)
    tok = loaded.tokenizer
    vocab = GrammarVocabulary(tok.hf.to_str(), loaded.model.args.vocab_size, loaded.eos_token_ids)
    return Rig(loaded, vocab, marker_tag(tok))


@pytest.fixture(scope="module")
def rigs() -> dict[str, Rig]:
    return {}


@pytest.fixture
def rig_for(
    request: pytest.FixtureRequest, rigs: dict[str, Rig], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Rig]:
    def get(fmt: str) -> Rig:
        name = FORMATS[fmt]
        if name not in rigs:
            folder = request.getfixturevalue(TOKENIZER_FIXTURES[name])
            rigs[name] = _build_rig(folder, tmp_path_factory.mktemp(f"tiny-{name}"))
        return rigs[name]

    return get


def _parser_name(fmt: str) -> str:
    return "deepseek-v3.1" if fmt == "deepseek-text" else fmt


def _grammar(rig: Rig, fmt: str, tools: Sequence[dict[str, Any]], **kw: Any) -> CallGrammar:
    grammar = call_grammar(_parser_name(fmt), tools, tag=rig.tag, **kw)
    assert grammar is not None
    return grammar


# -- running the model --------------------------------------------------------------------


def _sample(
    rig: Rig,
    prompt: str,
    matcher: TokenMatcher,
    *,
    seed: int,
    towards: Sequence[int] = (),
    max_tokens: int = MAX_TOKENS,
) -> tuple[str, bool]:
    """The model's text after `prompt` under `matcher`, sampled at temperature 1: (the
    text, whether it ended with EOS). A bias pushes it to write the tokens `towards`:
    always the next one after the longest part of them the output ends with."""
    model, eos = rig.loaded.model, rig.loaded.eos_token_ids
    rng = np.random.default_rng(seed)
    caches = model.make_caches()
    step = mx.array([rig.loaded.tokenizer.encode(prompt)])
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(step, caches)[0, -1]
        mx.eval(logits)
        scores = np.array(logits, dtype=np.float64)
        if towards:
            done = max(k for k in range(len(towards)) if k == 0 or out[-k:] == list(towards[:k]))
            scores[towards[done]] += 60.0
        scores[~matcher.allowed()] = -np.inf
        probs = np.exp(scores - scores.max())
        token = int(rng.choice(len(probs), p=probs / probs.sum()))
        if token in eos:
            return rig.text(out), True
        matcher.advance(token)
        out.append(token)
        step = mx.array([[token]])
    return rig.text(out), False


def _calls(fmt: str, tools: Sequence[dict[str, Any]], text: str) -> list[tuple[str, Any]]:
    """(name, arguments) of each call the format's parser reads in `text`."""
    parser = parsers.create(_parser_name(fmt), tools=tools, think=False)
    events = parser.feed(text) + parser.finish()
    out = []
    for start in (e for e in events if isinstance(e, ToolCallStart)):
        pieces = (
            e.fragment for e in events if isinstance(e, ToolCallArgs) and e.index == start.index
        )
        out.append((start.name, json.loads("".join(pieces))))
    return out


def _check_calls(
    calls: list[tuple[str, Any]], tools: Sequence[dict[str, Any]], context: str
) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, args in calls:
        assert name in schemas, f"{context}: undeclared tool {name!r}"
        jsonschema.validate(args, schemas[name])
        custom = schemas[name].get("properties", {}).get("input", {}).get(GRAMMAR_KEY)
        if custom is not None:  # the custom grammar's language, by our flattening of it
            regex = lark_to_regex(custom["definition"])
            assert regex is not None
            jsonschema.validate(args["input"], {"type": "string", "pattern": f"^(?:{regex})$"})


PROMPTS = {
    "qwen3": "<|im_start|>user\nCall a tool.<|im_end|>\n<|im_start|>assistant\n",
    "deepseek_v3": "<｜User｜>Call a tool.<｜Assistant｜></think>",
    "llama3": "<|start_header_id|>user<|end_header_id|>\n\nCall a tool.<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


# -- forced calls under sampling ----------------------------------------------------------


@pytest.mark.parametrize("tool_set", sorted(TOOL_SETS))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_calls_parse_to_declared_tools_with_valid_arguments(
    rig_for: Callable[[str], Rig], fmt: str, tool_set: str
) -> None:
    declared = TOOL_SETS[tool_set]()
    if not declared:
        pytest.skip("no captured client requests")
    rig = rig_for(fmt)
    small = _bounded_tools(declared)
    for seed in range(3):
        parallel = seed != 1
        grammar = _grammar(rig, fmt, small, parallel=parallel)
        matcher = rig.vocab.matcher(Constraint(grammar.after_opener, grammar.parts, name="tools"))
        text, ended = _sample(rig, PROMPTS[FORMATS[fmt]] + grammar.opener, matcher, seed=seed)
        context = f"{fmt}/{tool_set}/seed {seed}: {grammar.opener + text!r}"[:600]
        assert ended, context
        calls = _calls(fmt, declared, grammar.opener + text)
        assert calls and (parallel or len(calls) == 1), context
        _check_calls(calls, declared, context)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_named_call_calls_that_tool(rig_for: Callable[[str], Rig], fmt: str) -> None:
    rig = rig_for(fmt)
    grammar = _grammar(rig, fmt, _bounded_tools(TYPED), only=["configure"], parallel=False)
    assert "configure" in grammar.opener  # one candidate: the prompt names it
    for seed in range(2):
        matcher = rig.vocab.matcher(Constraint(grammar.after_opener, grammar.parts))
        text, ended = _sample(rig, PROMPTS[FORMATS[fmt]] + grammar.opener, matcher, seed=seed)
        assert ended
        calls = _calls(fmt, TYPED, grammar.opener + text)
        assert [name for name, _ in calls] == ["configure"]
        _check_calls(calls, TYPED, text)


# -- tool_choice auto ---------------------------------------------------------------------


def _opener(rig: Rig, fmt: str) -> list[int]:
    """The tokens of the format's call opener."""
    calls = "<｜tool▁calls▁begin｜>"
    opener = {"llama3-json": '{"name": "', "deepseek-v3.1": calls, "deepseek-v3": calls}
    return rig.ids(opener.get(fmt, "<tool_call>"))


@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - {"deepseek-text"}))
def test_auto_calls_that_happen_parse_and_validate(rig_for: Callable[[str], Rig], fmt: str) -> None:
    rig = rig_for(fmt)
    declared = SMALL + TYPED
    grammar = _grammar(rig, fmt, _bounded_tools(declared), parallel=False)
    for seed in range(3):
        biased = seed > 0
        matcher = rig.vocab.matcher(Constraint(grammar.lazy, grammar.parts, name="tools"))
        towards = _opener(rig, fmt) if biased else []
        prompt = PROMPTS[FORMATS[fmt]]
        text, _ = _sample(rig, prompt, matcher, seed=seed, towards=towards, max_tokens=300)
        calls = _calls(fmt, declared, text)
        context = f"{fmt}/seed {seed}: {text!r}"[:600]
        # biased, the model calls; never twice (a second opener is refused)
        assert len(calls) == 1 if biased else len(calls) <= 1, context
        _check_calls(calls, declared, context)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_auto_never_forces_a_call(rig_for: Callable[[str], Rig], fmt: str) -> None:
    """EOS is allowed from the first token on, and plain text is free."""
    rig = rig_for(fmt)
    grammar = _grammar(rig, fmt, SMALL)
    matcher = rig.vocab.matcher(Constraint(grammar.lazy, grammar.parts))
    assert matcher.allowed()[sorted(rig.loaded.eos_token_ids)].all()
    for text in ("", "The weather is fine.", "Ünïcode, lines\n\nand <b>tags</b> {x}"):
        assert _accepts(rig, Constraint(grammar.lazy, grammar.parts), text), text


# -- hand-written calls -------------------------------------------------------------------


def _accepts(rig: Rig, constraint: Constraint, text: str) -> bool:
    """Whether the grammar takes `text` whole (tokenized as the vocabulary does)."""
    matcher = rig.vocab.matcher(constraint)
    try:
        for token in rig.ids(text):
            matcher.advance(token)
    except ConstraintError:
        return False
    return matcher.accepting


def _qc(name: str, *args: tuple[str, str]) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args)
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm(name: str, *args: tuple[str, str], nl: str = "") -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in args)
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


def _ds(*calls: tuple[str, str]) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{a}<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _ds3(*calls: tuple[str, str]) -> str:
    """DeepSeek-V3's form: `function<sep>NAME` and a fenced object, calls a line apart."""
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{a}\n```<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


W1, W2 = '{"city": "Paris", "unit": "celsius"}', '{"zone": "UTC"}'
CONFIG = {
    "count": "3",
    "ratio": "0.5",
    "on": "true",
    "tags": '["a", "bc"]',
    "meta": '{"k": "v"}',
    "note": "short",
    "mode": "fast",
    "size": "M",
}
# format -> (valid calls, invalid calls) to SMALL + TYPED, as the templates write them
CASES: Mapping[str, tuple[list[str], list[str]]] = {
    "qwen3-coder": (
        [
            _qc("get_weather", ("city", "Paris"), ("unit", "celsius")),
            _qc("noop") + "\n" + _qc("get_time", ("zone", "UTC")),
            _qc("get_weather", ("city", "a\nb c"), ("unit", "fahrenheit")),
            _qc("configure", *CONFIG.items()),
            _qc("configure", *{**CONFIG, "note": "null"}.items()),
            _qc("calc", ("input", "add 12")),
        ],
        [
            _qc("get_wether", ("city", "Paris"), ("unit", "celsius")),  # undeclared
            _qc("get_weather", ("city", "Paris")),  # a required argument missing
            _qc("get_weather", ("city", "Paris"), ("unit", "kelvin")),  # not in the enum
            _qc("get_weather", ("city", "far too long"), ("unit", "celsius")),
            _qc("get_weather", ("city", "a</function>"), ("unit", "celsius")),  # a marker
            _qc("get_time", ("zone", "utc")),  # the pattern
            _qc("configure", *{**CONFIG, "count": "12"}.items()),  # over the maximum
            _qc("configure", *{**CONFIG, "note": "toolong"}.items()),
            _qc("configure", *{**CONFIG, "note": "None"}.items()),  # would read as null
            _qc("configure", *{**CONFIG, "tags": '["a","b"]'}.items()),  # not the layout
            _qc("calc", ("input", "mul 2")),  # not the custom grammar
            _qc("noop", ("x", "1")),  # no extra arguments
        ],
    ),
    "glm-4.7": (
        [
            _glm("get_weather", ("city", "Paris"), ("unit", "celsius")),
            _glm("noop") + _glm("get_time", ("zone", "UTC")),
            _glm("configure", *CONFIG.items()),
            _glm("calc", ("input", "sub 7")),
        ],
        [
            _glm("get_weather", ("city", "Paris")),
            _glm("get_weather", ("city", "Pa<arg_key>"), ("unit", "celsius")),
            _glm("configure", *{**CONFIG, "on": "yes"}.items()),
            _glm("configure", *{**CONFIG, "size": "XL"}.items()),
            _glm("calc", ("input", "add")),
            _glm("get_weather", ("city", "Paris"), ("unit", "celsius"), nl="\n"),
        ],
    ),
    "glm-4.5": (
        [
            _glm("get_weather", ("city", "Paris"), ("unit", "celsius"), nl="\n"),
            _glm("noop", nl="\n") + "\n" + _glm("calc", ("input", "add 1"), nl="\n"),
        ],
        [_glm("get_weather", ("city", "Paris"), ("unit", "celsius"))],
    ),
    "deepseek-v3.1": (
        [
            _ds(("get_weather", W1)),
            _ds(("noop", "{}"), ("get_time", W2)),
            _ds(("calc", '{"input": "add 123"}')),
        ],
        [
            _ds(("get_weather", '{"city": "Paris"}')),
            _ds(("get_weather", '{"city":"Paris","unit":"celsius"}')),
            _ds(("get_time", '{"zone": "UTC", "extra": 1}')),
            _ds(("calc", '{"input": "add 1234"}')),
            _ds(("nothing", "{}")),
        ],
    ),
    "hermes": (
        [
            _hermes("get_weather", W1),
            _hermes("noop", "{}") + "\n" + _hermes("get_time", W2),
            _hermes("calc", '{"input": "sub 0"}'),
        ],
        [_hermes("get_time", '{"zone": "Utc"}'), _hermes("calc", '{"input": "add  1"}')],
    ),
    "llama3-json": (
        [
            '{"name": "get_weather", "parameters": ' + W1 + "}",
            '{"name": "noop", "parameters": {}}; {"name": "get_time", "parameters": ' + W2 + "}",
            '{"name": "calc", "parameters": {"input": "add 5"}}',
        ],
        [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            '{"name": "ls", "parameters": {}}',
            '{"name": "calc", "parameters": {"input": "add 5 "}}',
        ],
    ),
}
CASES = {
    **CASES,
    "deepseek-text": CASES["deepseek-v3.1"],
    "deepseek-v3": (
        [
            _ds3(("get_weather", W1)),
            _ds3(("noop", "{}"), ("get_time", W2)),
            _ds3(("calc", '{"input": "add 123"}')),
        ],
        [
            _ds3(("get_weather", '{"city": "Paris"}')),
            _ds(("get_weather", W1)),  # the V3.1 form
            _ds3(("nothing", "{}")),
        ],
    ),
}
CALL_MARK = {  # what each call in a format's text writes once
    "qwen3-coder": "<function=",
    "glm-4.7": "<tool_call>",
    "glm-4.5": "<tool_call>",
    "deepseek-v3.1": "<｜tool▁call▁begin｜>",
    "deepseek-v3": "<｜tool▁call▁begin｜>",
    "deepseek-text": "<｜tool▁call▁begin｜>",
    "hermes": "<tool_call>",
    "llama3-json": '{"name"',
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_hand_written_calls(rig_for: Callable[[str], Rig], fmt: str) -> None:
    """Valid calls are taken whole by each form of the grammar (forced after its
    opener, beside a response format, and inside free text with auto) and read back
    by the parser as valid calls; broken ones are refused by every form."""
    rig = rig_for(fmt)
    tools = SMALL + TYPED
    grammar = _grammar(rig, fmt, tools)
    beside = Constraint("start: calls\n" + grammar.rules, grammar.parts)
    lazy = Constraint(grammar.lazy, grammar.parts)
    after = Constraint(grammar.after_opener, grammar.parts)
    around = ("", "") if fmt == "llama3-json" else ("Let me look. ", "\nDone.")
    valid, invalid = CASES[fmt]
    for text in valid:
        assert text.startswith(grammar.opener)
        assert _accepts(rig, after, text[len(grammar.opener) :]), text
        assert _accepts(rig, beside, text), text
        assert _accepts(rig, lazy, around[0] + text + around[1]), text
        calls = _calls(fmt, tools, text)
        assert len(calls) == text.count(CALL_MARK[fmt]), text
        _check_calls(calls, tools, text)
    for text in invalid:
        assert not _accepts(rig, beside, text), text
        assert not _accepts(rig, lazy, around[0] + text), text
        if text.startswith(grammar.opener):
            assert not _accepts(rig, after, text[len(grammar.opener) :]), text


def test_auto_refuses_call_syntax_outside_a_call(rig_for: Callable[[str], Rig]) -> None:
    """Free text cannot spell a call opener out in pieces (the parser would read a
    call the grammar never checked), and without parallel calls a second call cannot
    start."""
    rig = rig_for("qwen3-coder")
    one = _grammar(rig, "qwen3-coder", SMALL, parallel=False)
    lazy = Constraint(one.lazy, one.parts)
    call = _qc("noop")
    assert _accepts(rig, lazy, "ok " + call + " done")
    assert _accepts(rig, lazy, "bare <function=noop>\n</function> is read too")
    assert not _accepts(rig, lazy, call + " then " + call)
    assert not _accepts(rig, lazy, "bare <function=ls>\n</function>")
    spelled = rig.ids("a <tool_") + rig.ids("call>\n<function=noop>\n</function>\n")
    assert rig.hf.token_to_id("<tool_call>") not in spelled
    matcher = rig.vocab.matcher(lazy)
    with pytest.raises(ConstraintError):
        for token in spelled:
            matcher.advance(token)


def test_auto_leaves_reasoning_free(rig_for: Callable[[str], Rig]) -> None:
    """Behind a reasoning block (the prompt ends inside <think>), the lazy grammar
    starts at </think>."""
    rig = rig_for("hermes")
    grammar = _grammar(rig, "hermes", SMALL)
    lazy = replace(Constraint(grammar.lazy, grammar.parts), reasoning="open")
    call = _hermes("get_time", W2)
    assert _accepts(rig, lazy, "hmm, a call maybe</think>\n\nSure. " + call)
    assert not _accepts(rig, lazy, "hmm</think>\n\n" + _hermes("get_time", '{"zone": "x"}'))


def test_special_token_closers(rig_for: Callable[[str], Rig]) -> None:
    """Where a value's closing marker is one token (GLM's vocabulary has
    `</arg_value>` as one), the raw text runs up to that token."""
    rig = rig_for("glm-4.7")
    stand_in = rig.hf.token_to_id("<|quad_end|>")
    assert stand_in is not None

    def tag(marker: str) -> str:
        return f"<[{stand_in}]>" if marker == "</arg_value>" else rig.tag(marker)

    grammar = call_grammar("glm-4.7", SMALL, tag=tag)
    assert grammar is not None
    beside = Constraint("start: calls\n" + grammar.rules, grammar.parts)
    good = _glm("get_weather", ("city", "Paris"), ("unit", "celsius"))
    assert _accepts(rig, beside, good.replace("</arg_value>", "<|quad_end|>"))
    long = _glm("get_weather", ("city", "Parisian!!"), ("unit", "celsius"))
    assert not _accepts(rig, beside, long.replace("</arg_value>", "<|quad_end|>"))


def test_tools_a_format_cannot_carry_are_left_out(rig_for: Callable[[str], Rig]) -> None:
    """An XML value is read back as a string whenever the schema has no type, so an
    untyped enum of numbers cannot be met; a name with a space is no qwen3-coder name."""
    rig = rig_for("qwen3-coder")
    numbers = _tool(
        "pick", {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"]}
    )
    spaced = _tool("two words", NOOP)
    assert call_grammar("qwen3-coder", [numbers, spaced], tag=rig.tag) is None
    grammar = _grammar(rig, "qwen3-coder", [numbers, *SMALL])
    assert _accepts(rig, Constraint("start: calls\n" + grammar.rules), _qc("noop"))
    assert not _accepts(rig, Constraint("start: calls\n" + grammar.rules), _qc("pick", ("n", "1")))
    # JSON formats write the number itself
    assert call_grammar("hermes", [numbers], tag=rig.tag) is not None


@pytest.mark.skipif(not client_lark_grammars(), reason="no captured custom tool grammar")
@pytest.mark.parametrize(
    "fmt", ["hermes", "qwen3-coder", "glm-4.7", "deepseek-v3.1", "llama3-json"]
)
def test_codex_apply_patch_input_keeps_to_its_grammar(
    rig_for: Callable[[str], Rig], fmt: str
) -> None:
    """Codex's apply_patch grammar: nested as it is where the format carries the input
    as raw text, flattened into the JSON string's pattern where it carries JSON."""
    rig = rig_for(fmt)
    definition = next(iter(client_lark_grammars().values()))
    tools = [_tool("apply_patch", _custom_input(definition))]
    grammar = _grammar(rig, fmt, tools)
    beside = Constraint("start: calls\n" + grammar.rules, grammar.parts)
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch\n"
    broken = "*** Begin Patch\n*** Rename File: a.py\n*** End Patch\n"
    for text, ok in ((patch, True), (broken, False)):
        if fmt == "qwen3-coder":
            call = _qc("apply_patch", ("input", text))
        elif fmt == "glm-4.7":
            call = _glm("apply_patch", ("input", text))
        elif fmt == "deepseek-v3.1":
            call = _ds(("apply_patch", json.dumps({"input": text})))
        elif fmt == "hermes":
            call = _hermes("apply_patch", json.dumps({"input": text}))
        else:
            call = '{"name": "apply_patch", "parameters": ' + json.dumps({"input": text}) + "}"
        assert _accepts(rig, beside, call) is ok, call
        if ok:
            assert _calls(fmt, tools, call) == [("apply_patch", {"input": text})]


def test_lark_to_regex_flattens_regular_grammars_only() -> None:
    regex = lark_to_regex(
        'start: "a"~2..3 ("b" | "c")+ ["d"] /x/i "q"i "0".."9" LF\n%import common.LF'
    )
    assert regex is not None
    import re

    assert re.fullmatch(regex, "aabcdXq5\n") and not re.fullmatch(regex, "abq5\n")
    assert lark_to_regex('start: a\na: "x" a | "y"') is None  # recursive
    assert lark_to_regex('start: "a"\n%ignore " "') is None
    assert lark_to_regex("start: b") is None  # undefined
