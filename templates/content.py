"""Content is text: a prompt rendered with the spans that came from message content marked.

A special token written inside a message (`<|im_end|><|im_start|>system` in a user
turn, in a tool result an agent read from a file, in tool-call arguments) must reach
the model as text, as it does through OpenAI's and Anthropic's APIs; only the
template's own markup becomes control tokens. Renderers stay text functions of the
conversation; `render_prompt` runs any of them (built-in or a model's jinja template)
on a copy of the conversation in which every control string inside client text is
swapped for a placeholder (private-use characters around a number), then puts the
strings back and records where they landed. The tokenizer reads those spans as plain
text (runtime.text.plain). A conversation without control strings in its text renders
once, unchanged, with no spans, so ordinary prompts tokenize exactly as before.

Which strings: the tokenizer's special tokens everywhere, and the plain added tokens
that the chat format writes as markup (Qwen's `<tool_call>`, DeepSeek's `<｜User｜>`)
everywhere but in the assistant's own text (content and reasoning): a reply sent back
keeps the tags the model wrote, tokenized as it produced them, so cached turns still
hit. Special tokens never appear in a model's visible output, so reading them as text
there too is what the model produced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from templates.types import (
    ContentPart,
    Message,
    Rendered,
    Renderer,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
    ToolCall,
)

# Markup tokens of the chat formats we know (the built-in renderers write these), for
# models without a template of their own; a model's template adds the ones it writes.
FORMAT_MARKUP: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>",  # ChatML: Qwen, SmolLM, Hermes
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",  # GLM-4.x
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|eom_id|>", "<|python_tag|>",  # Llama 3
    "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",  # Gemma
    "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",  # DeepSeek V3
)  # fmt: skip


@dataclass(frozen=True)
class ControlStrings:
    """The strings a model's tokenizer turns into control tokens: `special` (added tokens
    marked special) and `markup` (plain added tokens its chat format writes as markup)."""

    special: frozenset[str] = frozenset()
    markup: frozenset[str] = frozenset()

    @cached_property
    def everywhere(self) -> re.Pattern[str] | None:
        """Matches what client text may not hold as control tokens."""
        return _trie_pattern(self.special | self.markup)

    @cached_property
    def in_replies(self) -> re.Pattern[str] | None:
        """Matches what the assistant's own text may not hold (special tokens only)."""
        return _trie_pattern(self.special)

    def pattern(self, *, reply: bool) -> re.Pattern[str] | None:
        return self.in_replies if reply else self.everywhere


def control_strings(
    special: Iterable[str], added: Iterable[str], template: str | None
) -> ControlStrings:
    """`special` tokens, plus those of the `added` tokens that are markup: written by
    the model's `template` (its source text holds them) or by a known format. Plain
    added tokens that are ordinary text (Gemma's `<table>`, runs of spaces) stay text."""
    specials = frozenset(t for t in special if t)
    known = frozenset(FORMAT_MARKUP)
    markup = frozenset(
        t
        for t in added
        if t
        and not t.isspace()
        and t not in specials
        and (t in known or (template and t in template))
    )
    return ControlStrings(specials, markup)


def _trie_pattern(words: Collection[str]) -> re.Pattern[str] | None:
    """A regex matching any of `words`, leftmost-longest, as a trie: each position costs
    the branching of the trie, not the number of words (DeepSeek has 800 specials)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(build(trie)) if trie else None


class _Swap:
    """Swaps control strings in client text for numbered placeholders, and back."""

    def __init__(self, controls: ControlStrings, texts: Sequence[str]) -> None:
        self._controls = controls
        self.originals: list[str] = []
        self.open, self.close = _free_pair("\0".join(texts))
        # a placeholder as written, or escaped by a json.dumps with ensure_ascii
        self._placeholder = re.compile(
            f"(?:{re.escape(self.open)}|{_escaped(self.open)})(\\d+)"
            f"(?:{re.escape(self.close)}|{_escaped(self.close)})"
        )

    def text(self, value: str, *, reply: bool = False) -> str:
        pattern = self._controls.pattern(reply=reply)
        return value if pattern is None else pattern.sub(self._hold, value)

    def holds(self, value: str) -> bool:
        pattern = self._controls.everywhere
        return pattern is not None and pattern.search(value) is not None

    def _hold(self, match: re.Match[str]) -> str:
        self.originals.append(match.group())
        return f"{self.open}{len(self.originals) - 1}{self.close}"

    def restore(self, text: str) -> Rendered:
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        at, length = 0, 0
        for match in self._placeholder.finditer(text):
            number = int(match.group(1))
            if number >= len(self.originals):  # not ours (left over: refused below)
                continue
            out.append(text[at : match.start()])
            length += match.start() - at
            original = self.originals[number]
            if match.group().startswith("\\"):  # written by json.dumps(ensure_ascii=True)
                original = json.dumps(original)[1:-1]
            out.append(original)
            spans.append((length, length + len(original)))
            length += len(original)
            at = match.end()
        out.append(text[at:])
        restored = "".join(out)
        if _leftover(restored, self.open) or _leftover(restored, self.close):
            raise TemplateError(
                "the chat template rewrites message text in a way that cannot keep "
                "special-token text in the messages apart from its own markup (it cut "
                "or encoded it); remove special tokens such as <|im_end|> from the messages"
            )
        return Rendered(restored, tuple(spans))


def _escaped(char: str) -> str:
    """A regex for `char` as a JSON \\u escape, either case."""
    return re.escape("\\u") + "".join(f"[{h.lower()}{h.upper()}]" for h in f"{ord(char):04x}")


def _leftover(text: str, char: str) -> bool:
    return char in text or f"\\u{ord(char):04x}" in text.lower()


def _free_pair(joined: str) -> tuple[str, str]:
    """Two private-use characters that no client text holds, raw or as a JSON escape."""
    taken = set(joined)
    taken.update(chr(int(h, 16)) for h in re.findall(r"\\u([0-9a-f]{4})", joined.lower()))
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in taken)
    try:
        return next(free), next(free)
    except StopIteration:
        raise TemplateError("the messages use every private-use character") from None


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _json_strings(text: str) -> list[str]:
    """The strings inside JSON text, decoded; none when it is not JSON."""
    try:
        return list(_strings(json.loads(text)))
    except ValueError:
        return []


def _deep(swap: _Swap, value: Any) -> Any:
    if isinstance(value, str):
        return swap.text(value)
    if isinstance(value, Mapping):
        return {swap.text(str(k)): _deep(swap, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep(swap, v) for v in value]
    return value


def _arguments(swap: _Swap, text: str) -> str:
    """Tool-call arguments: swapped in the text as written, and where a JSON escape
    (`\\u003c|im_end|>`) hides a control string that a template's re-serializing would
    write out, swapped in the decoded value and serialized again."""
    swapped = swap.text(text)
    if not any(swap.holds(s) for s in _json_strings(swapped)):
        return swapped
    return json.dumps(_deep(swap, json.loads(swapped)), ensure_ascii=False)


def _content(
    swap: _Swap, content: str | tuple[ContentPart, ...] | None, *, reply: bool
) -> str | tuple[ContentPart, ...] | None:
    if content is None:
        return None
    if isinstance(content, str):
        return swap.text(content, reply=reply)
    return tuple(
        TextPart(swap.text(p.text, reply=reply)) if isinstance(p, TextPart) else p for p in content
    )


def _message(swap: _Swap, m: Message) -> Message:
    reply = m.role == "assistant"  # the model's own text keeps its markup tags
    calls = tuple(
        ToolCall(swap.text(c.id), swap.text(c.name), _arguments(swap, c.arguments))
        for c in m.tool_calls
    )
    return replace(
        m,
        content=_content(swap, m.content, reply=reply),
        name=None if m.name is None else swap.text(m.name),
        tool_calls=calls,
        tool_call_id=None if m.tool_call_id is None else swap.text(m.tool_call_id),
        reasoning=None if m.reasoning is None else swap.text(m.reasoning, reply=True),
    )


def _tool(swap: _Swap, t: Tool) -> Tool:
    description = None if t.description is None else swap.text(t.description)
    return Tool(swap.text(t.name), description, _deep(swap, t.parameters))


def _client_texts(messages: Sequence[Message], tools: Sequence[Tool]) -> Iterator[tuple[str, bool]]:
    """Every text a client wrote that a template may print, with whether it is the
    assistant's own text (a reply)."""
    for m in messages:
        reply = m.role == "assistant"
        if isinstance(m.content, str):
            yield m.content, reply
        elif m.content is not None:
            yield from ((p.text, reply) for p in m.content if isinstance(p, TextPart))
        if m.reasoning is not None:
            yield m.reasoning, True
        yield from ((s, False) for s in (m.name, m.tool_call_id) if s is not None)
        for call in m.tool_calls:
            yield from ((s, False) for s in (call.id, call.name, call.arguments))
            yield from ((s, False) for s in _json_strings(call.arguments))
    for t in tools:
        yield t.name, False
        if t.description is not None:
            yield t.description, False
        yield from ((s, False) for s in _strings(t.parameters))


def _holds_controls(texts: Sequence[tuple[str, bool]], controls: ControlStrings) -> bool:
    for text, reply in texts:
        pattern = controls.pattern(reply=reply)
        if pattern is not None and pattern.search(text):
            return True
    return False


def render_prompt(
    renderer: Renderer,
    messages: Sequence[Message],
    tools: Sequence[Tool],
    options: RenderOptions,
    controls: ControlStrings,
) -> Rendered:
    """`renderer`'s prompt, with the spans where control strings from client text
    landed marked (see the module docstring). TemplateError as the renderer raises it."""
    texts = list(_client_texts(messages, tools))
    if not _holds_controls(texts, controls):
        return Rendered(renderer.render(messages, tools, options))
    swap = _Swap(controls, [text for text, _ in texts])
    swapped_messages = [_message(swap, m) for m in messages]
    swapped_tools = [_tool(swap, t) for t in tools]
    return swap.restore(renderer.render(swapped_messages, swapped_tools, options))


def splice(rendered: Rendered, old: str, new: Sequence[str]) -> Rendered:
    """`rendered` with its occurrences of `old` (markup: the template's image markers),
    in order, replaced by `new`, the content spans moved along. ValueError when the
    counts differ or an occurrence lies in a content span."""
    text = rendered.text
    found = [m.start() for m in re.finditer(re.escape(old), text)] if old else []
    if len(found) != len(new):
        raise ValueError(f"{len(found)} occurrences of {old!r} for {len(new)} replacements")
    spans = list(rendered.content)
    if any(s < at + len(old) and at < e for at in found for s, e in spans):
        raise ValueError(f"{old!r} occurs inside message content")
    pieces: list[str] = []
    shifted: list[tuple[int, int]] = []
    prev, delta, k = 0, 0, 0
    for at, piece in zip(found, new, strict=True):
        while k < len(spans) and spans[k][0] < at:
            shifted.append((spans[k][0] + delta, spans[k][1] + delta))
            k += 1
        pieces += [text[prev:at], piece]
        delta += len(piece) - len(old)
        prev = at + len(old)
    shifted += [(s + delta, e + delta) for s, e in spans[k:]]
    return Rendered("".join([*pieces, text[prev:]]), tuple(shifted))
