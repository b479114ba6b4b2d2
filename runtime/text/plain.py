"""Encoding a rendered chat prompt whose content spans read as plain text.

A special token (or a chat format's markup token) written inside message content must
not become a control token: only the template's own markup does. The prompt is encoded
whole, exactly as before; only where an added token matched inside a content span is
the text between its neighbouring kept added tokens encoded again, by a copy of the
tokenizer that matches no added token. Everywhere else the ids are the whole prompt's
own, so ordinary prompts (and the prefix cache's keys) are unchanged.

The `tokenizers` library encodes the text between two added-token matches on its own
(it splits there before normalizing and pre-tokenizing), so a region encoded alone
gives the ids it gets inside the whole prompt; the one exception, a pre-tokenizer that
only treats the very start of the text differently (Metaspace `prepend_scheme:
first`), is met by encoding the region behind a sentinel added token.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Sequence

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

# An added token of the copy only: text that follows it is "not the start of the text".
_SENTINEL = "\U000f8f7a\U000fb00c\U0010a1e2"


class PlainEncoder:
    """A copy of a tokenizer that matches no added token (all of them are marked special
    and special-token matching is off), built on first use: most servers never need it."""

    def __init__(self, hf: HFTokenizer) -> None:
        self._hf = hf
        self._lock = threading.Lock()
        self._copy: HFTokenizer | None = None
        self._sentinel_id = -1

    def _tokenizer(self) -> tuple[HFTokenizer, int]:
        with self._lock:
            if self._copy is None:
                data = json.loads(self._hf.to_str())
                for token in data.get("added_tokens") or []:
                    token["special"] = True
                copy = HFTokenizer.from_str(json.dumps(data))
                copy.encode_special_tokens = True
                copy.add_tokens([AddedToken(_SENTINEL, special=False, normalized=False)])
                sentinel = copy.token_to_id(_SENTINEL)
                assert sentinel is not None  # just added
                self._copy, self._sentinel_id = copy, sentinel
            return self._copy, self._sentinel_id

    def encode(self, text: str, *, at_start: bool) -> list[int]:
        """`text` as plain text. `at_start`: it begins the prompt (else it follows an
        added token, as it does in the prompt)."""
        copy, sentinel = self._tokenizer()
        if at_start or _SENTINEL in text:
            return list(copy.encode(text, add_special_tokens=False).ids)
        ids: list[int] = copy.encode(_SENTINEL + text, add_special_tokens=False).ids
        assert ids and ids[0] == sentinel
        return ids[1:]


def _overlaps(spans: Sequence[tuple[int, int]], starts: list[int], a: int, b: int) -> bool:
    """Whether [a, b) meets one of `spans` (sorted, not overlapping; `starts` their starts)."""
    i = bisect.bisect_left(starts, b)  # spans starting at or after b cannot meet it
    return i > 0 and spans[i - 1][1] > a


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def encode_with_plain_spans(
    hf: HFTokenizer,
    plain: PlainEncoder,
    added_ids: frozenset[int],
    text: str,
    spans: Sequence[tuple[int, int]],
) -> list[int]:
    """`text`'s ids (no BOS added), with every added token that meets one of `spans`
    (character ranges) read as plain text instead."""
    encoding = hf.encode(text, add_special_tokens=False)
    ids: list[int] = encoding.ids
    if not spans:
        return ids
    ordered = _merged(spans)
    starts = [s for s, _ in ordered]
    offsets = encoding.offsets
    bad = [
        i for i, t in enumerate(ids) if t in added_ids and _overlaps(ordered, starts, *offsets[i])
    ]
    if not bad:
        return ids
    flagged = set(bad)
    out: list[int] = []
    region_start, run_start, run_bad = 0, 0, False  # region in chars, run in tokens
    for i, token in enumerate(ids):
        if token not in added_ids:
            continue
        if i in flagged:
            run_bad = True
            continue
        start, end = offsets[i]  # a kept added token ends the region before it
        if run_bad:
            out += plain.encode(text[region_start:start], at_start=region_start == 0)
        else:
            out += ids[run_start:i]
        out.append(token)
        region_start, run_start, run_bad = end, i + 1, False
    if run_bad:
        out += plain.encode(text[region_start:], at_start=region_start == 0)
    else:
        out += ids[run_start:]
    return out
