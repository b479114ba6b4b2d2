"""Grammar-constrained decoding: per-request matchers and next-token masks (llguidance).

A `Constraint` (runtime/types.py) carries Lark text in llguidance's dialect; JSON schemas
are inlined as `%json {...}`. `GrammarVocabulary` imports the model's tokenizer into the
engine once per loaded model (about 1.5 s for a 150k vocabulary); `matcher()` compiles a
constraint against it (well under a millisecond for a JSON schema) into a
`TokenMatcher`, which gives the allowed-token mask of the next step and consumes the
sampled token. The mask costs tens of microseconds per token on the CPU (bench/
grammar_engines.py) and is computed while the device runs the model's next step
(runtime/batch/generate.py).

JSON is written compactly with the usual separators (`{"a": 1, "b": [2, 3]}`): free
whitespace would let a model pad forever, and this is what models write inline anyway.
EOS is allowed only where the grammar accepts. A reasoning block (Constraint.reasoning)
is left free: the grammar starts after the think-close tag.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import llguidance as llg
import mlx.core as mx
import numpy as np

from runtime.types import Constraint

# How JSON inside a grammar is laid out: compact, with the separators json.dumps uses.
JSON_LAYOUT: Mapping[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_GAP = r"/\n{0,2}/"  # what may sit between the think-close tag and the answer
_MAIN = "constrained_answer"  # the nested grammar behind a reasoning block
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_ECHO = re.compile(r"^\s*\d+ \| ")  # the engine's echo of the grammar line at fault


class ConstraintError(ValueError):
    """A grammar or schema the engine cannot compile, or a token it refuses."""

    def __init__(self, message: str, *, keywords: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.keywords = keywords  # the JSON-schema keywords the engine does not implement


# -- building grammars --------------------------------------------------------------------


def json_schema_rule(schema: Mapping[str, Any] | bool, *, lenient: bool = False) -> str:
    """`%json {...}`: a Lark expression for documents valid against `schema`, laid out
    as JSON_LAYOUT says. `lenient` ignores keywords the engine does not implement (the
    document then keeps to the rest of the schema) instead of refusing the schema."""
    if isinstance(schema, bool):
        body: dict[str, Any] = {} if schema else {"not": {}}
    elif isinstance(schema, Mapping):
        body = dict(schema)
    else:
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    options = dict(JSON_LAYOUT)
    if lenient:
        options["lenient"] = True
    given = body.get("x-guidance")
    body["x-guidance"] = {**(given if isinstance(given, Mapping) else {}), **options}
    try:
        text = json.dumps(body, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConstraintError(f"the JSON schema is not plain JSON: {exc}") from None
    return "%json " + text


def json_schema_constraint(
    schema: Mapping[str, Any] | bool, *, lenient: bool = False, name: str = "json_schema"
) -> Constraint:
    """Output that is one JSON document valid against `schema`."""
    return Constraint(f"start: {json_schema_rule(schema, lenient=lenient)}\n", name=name)


def lark_constraint(grammar: str, *, name: str = "grammar") -> Constraint:
    """Output that matches a Lark grammar (llguidance's dialect; its `start` rule)."""
    return Constraint(grammar if grammar.endswith("\n") else grammar + "\n", name=name)


def _error_message(raw: str) -> tuple[str, tuple[str, ...]]:
    """The engine's error without the echo of the grammar and the parser state that
    follow it, on one line; and the schema keywords it names as unimplemented."""
    lines = []
    for line in raw.strip().splitlines():
        if _ECHO.match(line) or line.startswith("<state>"):
            break
        if line.strip() and set(line.strip()) != {"^"}:
            lines.append(line.strip())
    message = re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines)) or "the grammar does not compile"
    found = _UNIMPLEMENTED.search(raw)
    keywords = tuple(json.loads(f"[{found.group(1)}]")) if found else ()
    return message, keywords


def grammar_json(main: str, parts: Iterable[tuple[str, str]] = ()) -> str:
    """The engine's input: a main Lark grammar and the named ones it refers to."""
    named = [{"name": name, "lark_grammar": text} for name, text in parts]
    return json.dumps({"grammars": [{"lark_grammar": main}, *named]})


def check(constraint: Constraint) -> None:
    """Compile the constraint's grammar without a vocabulary: raises ConstraintError
    saying what the engine cannot do (an unimplemented JSON-schema keyword, a Lark
    syntax error). Cheap enough for the request path (about a millisecond). The
    reasoning block is added with the vocabulary, in `GrammarVocabulary.matcher`."""
    if any(name == _MAIN for name, _ in constraint.parts):
        raise ConstraintError(f"the grammar name {_MAIN!r} is reserved")
    grammar = grammar_json(constraint.grammar, constraint.parts)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        message, keywords = _error_message(messages[0] if messages else "")
        raise ConstraintError(message, keywords=keywords)


# -- the vocabulary and per-request matchers ----------------------------------------------


class GrammarVocabulary:
    """A model's vocabulary imported into the grammar engine: build once per loaded
    model, then make a matcher per request.

    `tokenizer_json` is the tokenizers library's JSON (`Tokenizer.to_str()`);
    `vocab_size` is the width of the model's logits, which may differ from the
    tokenizer's count either way (padded embeddings; ids the model never writes)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(set(eos_ids)))
        if not self.eos_ids:
            raise ConstraintError("a constrained model needs at least one end-of-sequence id")
        count = _tokenizer_count(tokenizer_json)
        self._engine = llg.LLTokenizer(
            tokenizer_json, n_vocab=max(vocab_size, count), eos_token=list(self.eos_ids)
        )
        self._words = (self._engine.vocab_size + 31) // 32

    def _single_token(self, text: str) -> int | None:
        ids = self._engine.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self._engine.is_special_token(ids[0]) else None

    def _tag(self, text: str) -> str:
        """A think tag as a grammar item: its token when it is one special token, else
        its text."""
        token = self._single_token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    def _reasoning(self, close: str) -> tuple[str, str]:
        """(expression, extra rules) for free reasoning text up to and including the
        think-close tag, and the line breaks after it."""
        tag = self._tag(close)
        if tag.startswith("<["):  # one special token: free text cannot contain it
            return f"/(.|\\n)*/ {tag} {_GAP}", ""
        # a text tag: the reasoning ends at its first occurrence
        pattern = re.escape(close).replace("/", "\\/")
        return f"reasoning {_GAP}", f"reasoning[lazy]: /(?s:.*){pattern}/\n"

    def grammar_text(self, constraint: Constraint) -> str:
        """The grammar the engine compiles: the constraint's own, or, behind a free
        reasoning block that ends at the think-close tag, the constraint's as a nested
        grammar (so its rule names cannot clash with ours)."""
        main = constraint.grammar
        if constraint.reasoning != "none":
            block, rules = self._reasoning(constraint.think_close)
            if constraint.reasoning == "optional":
                opener = self._tag(constraint.think_open)
                lead = f"start: thinking? @{_MAIN}\nthinking: {opener} {block}\n"
            else:
                lead = f"start: {block} @{_MAIN}\n"
            parts: tuple[tuple[str, str], ...] = ((_MAIN, main), *constraint.parts)
            main = lead + rules
        else:
            parts = constraint.parts
        return grammar_json(main, parts)

    def matcher(self, constraint: Constraint) -> TokenMatcher:
        grammar = self.grammar_text(constraint)
        engine = llg.LLMatcher(self._engine, grammar, log_level=0)
        if engine.is_error():
            message, keywords = _error_message(engine.get_error())
            raise ConstraintError(f"{constraint.name}: {message}", keywords=keywords)
        return TokenMatcher(engine, self.vocab_size, self._words, constraint.name)


def _tokenizer_count(tokenizer_json: str) -> int:
    """One past the highest id a tokenizer.json names (the engine wants at least that)."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", 0) for t in data.get("added_tokens") or ()]
    return int(max(ids, default=-1)) + 1


class TokenMatcher:
    """One request's grammar state: `mask()` for the next step, `advance(token)` after
    it is sampled. Called on the engine thread only."""

    def __init__(self, engine: llg.LLMatcher, vocab_size: int, words: int, name: str) -> None:
        self._engine = engine
        self._vocab_size = vocab_size
        self._bits = np.zeros((words,), dtype=np.int32)
        self._name = name

    @property
    def accepting(self) -> bool:
        """The output so far is a complete document (EOS is allowed now)."""
        return bool(self._engine.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow."""
        return bool(self._engine.is_stopped())

    def allowed(self) -> np.ndarray:
        """The tokens allowed next, as a boolean vector as wide as the model's logits."""
        self._engine.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._engine.is_error():
            raise ConstraintError(f"{self._name}: {self._engine.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        if bits.shape[0] >= self._vocab_size:
            return bits[: self._vocab_size].view(np.bool_)
        return np.pad(bits, (0, self._vocab_size - bits.shape[0])).view(np.bool_)

    def mask(self) -> mx.array:
        """`allowed()` on the device, for `Sampler.sample(logits, mask)`."""
        return mx.array(self.allowed())

    def advance(self, token: int) -> None:
        """Consume a sampled token; a token the grammar refuses is an error (the mask
        allowed it only if something forced it past the mask)."""
        if not self._engine.consume_token(token):
            raise ConstraintError(
                f"{self._name}: the sampled token {token} breaks the grammar "
                f"({self._engine.get_error() or 'refused'})"
            )
