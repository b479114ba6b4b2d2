"""Stop strings: output is independent of chunking and cut at the earliest stop."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.text.stops import StopMatcher


def _expected(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    starts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(starts)], True) if starts else (text, False)


def _run(stops: Sequence[str], chunks: Sequence[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    out: list[str] = []
    hit = False
    for c in chunks:
        piece, hit = m.feed(c)
        out.append(piece)
        if hit:
            break
    if not hit:
        out.append(m.flush())
        hit = m.stopped
    return "".join(out), hit, out


def _split(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


ALPHABET = "ab c\n<>/"
texts = st.text(alphabet=ALPHABET, max_size=60)
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=6), max_size=4)


@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 60), max_size=20))
@settings(max_examples=600, deadline=None)
def test_random_chunking_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    got, hit, _ = _run(stops, _split(text, cuts))
    assert (got, hit) == _expected(text, stops)


@given(text=texts, stops=stop_lists)
@settings(max_examples=300, deadline=None)
def test_char_by_char_and_whole(text: str, stops: list[str]) -> None:
    expected = _expected(text, stops)
    assert _run(stops, list(text))[:2] == expected
    assert _run(stops, [text])[:2] == expected


@given(text=texts, stops=stop_lists)
@settings(max_examples=300, deadline=None)
def test_holds_back_only_possible_stop_prefixes(text: str, stops: list[str]) -> None:
    """After each character, everything not emitted is the longest suffix that is a prefix of
    some stop (no stop has completed yet in this text)."""
    if _expected(text, stops)[1]:
        return
    m = StopMatcher(stops)
    emitted = ""
    for i, ch in enumerate(text, start=1):
        piece, hit = m.feed(ch)
        assert not hit
        emitted += piece
        seen = text[:i]
        held = len(seen) - len(emitted)
        assert seen.startswith(emitted)
        longest = max(
            (k for k in range(1, len(seen) + 1) for s in stops if s.startswith(seen[-k:])),
            default=0,
        )
        assert held == longest


def test_basic_cut_and_after_stop_nothing() -> None:
    m = StopMatcher(["</s>", "STOP"])
    assert m.feed("hello <") == ("hello ", False)
    assert m.feed("/") == ("", False)
    assert m.feed("s> after") == ("", True)
    assert m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_false_alarm_released() -> None:
    m = StopMatcher(["</tool>"])
    assert m.feed("a </to") == ("a ", False)
    assert m.feed("ken>") == ("</token>", False)
    assert m.feed("</") == ("", False)
    assert m.flush() == "</"
    assert not m.stopped


def test_earliest_start_wins_over_earliest_end() -> None:
    # "bc" completes first, but "abcd" starts earlier and does complete.
    assert _run(["abcd", "bc"], ["x", "a", "b", "c", "d", "e"])[:2] == ("x", True)
    # If "abcd" dies, "bc" is the stop.
    assert _run(["abcd", "bc"], ["x", "a", "b", "c", "z"])[:2] == ("xa", True)
    # Ends during the wait: flush cuts at the pending stop.
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("xabc") == ("x", False)
    assert m.flush() == "a"
    assert m.stopped


def test_no_stops_passthrough() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
    assert m.flush() == ""
    m = StopMatcher([""])  # empty stops carry no meaning and are ignored
    assert m.feed("x") == ("x", False)


def test_unicode_and_overlapping_stops() -> None:
    assert _run(["👍👍", "🎉"], ["ok 👍", "👍 yes"])[:2] == ("ok ", True)
    assert _run(["aab"], ["a", "a", "a", "b"])[:2] == ("a", True)
    assert _run(["abab"], ["ab", "ab", "ab"])[:2] == ("", True)
