"""Flattening a Lark grammar into one regex is bounded while it expands: a grammar whose
rules each use the next one twice doubles at every level, and is refused as soon as the
regex passes MAX_REGEX_CHARS, with memory bounded by that (not by 2**levels); a long
chain of rules that each copy the one before is refused once MAX_EXPANSION_CHARS have
been built in all. Memory is measured with tracemalloc, never time."""

from __future__ import annotations

import tracemalloc

import pytest

from parsers.grammars import GrammarTooLarge
from parsers.grammars.lark_regex import MAX_EXPANSION_CHARS, MAX_REGEX_CHARS, lark_to_regex

MiB = 1024 * 1024


def doubling(levels: int) -> str:
    """2**levels copies of "ab" once flattened: 30 levels would be gigabytes."""
    rules = [f"r{i}: r{i + 1} r{i + 1}" for i in range(levels)]
    return "\n".join(["start: r0", *rules, f'r{levels}: "ab"'])


def chain(levels: int, width: int) -> str:
    """Each rule is the next one and `width` characters more: the flattened regex grows
    by a step per level, and all the rules' regexes together quadratically."""
    rules = [f'r{i}: r{i + 1} "{"x" * width}"' for i in range(levels)]
    return "\n".join(["start: r0", *rules, f'r{levels}: "ab"'])


def _peak_of(grammar: str) -> tuple[int, str]:
    tracemalloc.start()
    try:
        with pytest.raises(GrammarTooLarge) as refused:
            lark_to_regex(grammar)
        return tracemalloc.get_traced_memory()[1], str(refused.value)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("levels", [22, 30])
def test_a_doubling_grammar_is_refused_with_bounded_memory(levels: int) -> None:
    # flattened whole, 22 levels took 123 MB traced and 30 would take tens of GB
    peak, message = _peak_of(doubling(levels))
    assert peak < 1 * MiB, peak
    assert str(MAX_REGEX_CHARS) in message


def test_a_doubling_grammar_under_the_bound_still_flattens() -> None:
    regex = lark_to_regex(doubling(10))
    assert regex is not None and regex.count("ab") == 2**10
    assert len(regex) <= MAX_REGEX_CHARS


def test_a_long_chain_is_refused_once_the_work_passes_its_bound() -> None:
    grammar = chain(150, 300)
    # the whole regex would fit, but building it copies each level's text again
    assert 150 * 300 < MAX_REGEX_CHARS < MAX_EXPANSION_CHARS < 150 * 150 * 300 // 2
    peak, message = _peak_of(grammar)
    assert str(MAX_EXPANSION_CHARS) in message
    assert peak < 4 * MAX_EXPANSION_CHARS, peak  # one byte a character, a few copies alive


def test_a_short_chain_still_flattens() -> None:
    regex = lark_to_regex(chain(20, 300))
    assert regex is not None and regex.count("x" * 300) == 20
