"""Streaming detokenization equals tokenizers' own decode, chunk by chunk and in total."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from runtime.text.detokenizer import (
    DecoderKind,
    DetokenizerTable,
    StreamingDetokenizer,
    special_token_ids,
)

REAL_TEXTS = (
    "Hello, world!",
    " leading space and trailing space ",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 thumbs, 🇯🇵 Japan",
    "你好，世界。日本語のテキスト、한국어 텍스트",
    'def f(x: int) -> str:\n    return f"{x!r:>10}"  # → ok\n\n\tpass\n',
    "∮ E⋅da = Q,  n → ∞, ∑ f(i) = ∏ g(i); Ünïcödé ÆØÅ ß",
    "\u200b zero width, \u00a0 nbsp, 𝕏 math, 𓀀 hieroglyph, \U0010fffd private",
    "  multiple   spaces\n\n\nnewlines\r\n",
)

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Case:
    tokenizer: Tokenizer
    table: DetokenizerTable
    pools: tuple[tuple[int, ...], ...]  # interesting id groups to draw from


def _stream(table: DetokenizerTable, ids: Sequence[int]) -> list[str]:
    detok = StreamingDetokenizer(table)
    return [detok.add(i) for i in ids] + [detok.flush()]


def _decode(tok: Tokenizer, ids: Sequence[int], skip: bool = True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip)


def _check_prefixes(case: Case, ids: Sequence[int], max_remainder: int) -> None:
    """After each token the emitted text is a prefix of decoding what came so far, and what is
    still held back is small (only an unfinished character or byte run)."""
    detok = StreamingDetokenizer(case.table)
    emitted = ""
    for n, token_id in enumerate(ids, start=1):
        emitted += detok.add(token_id)
        so_far = _decode(case.tokenizer, ids[:n])
        assert so_far.startswith(emitted), (ids[:n], emitted, so_far)
        assert len(so_far) - len(emitted) <= max_remainder, (ids[:n], emitted, so_far)
    emitted += detok.flush()
    assert emitted == _decode(case.tokenizer, ids)


def _pools_for(table: DetokenizerTable, tok: Tokenizer) -> tuple[tuple[int, ...], ...]:
    rng = random.Random(0)
    ids_bytes: list[int] = []
    ids_multibyte: list[int] = []
    ids_plain: list[int] = []
    n = len(table.byte_pieces or table.sp_pieces)
    for i in range(n):
        raw = table.token_bytes(i)
        fallback_byte = table.kind is DecoderKind.SENTENCEPIECE and isinstance(
            table.sp_pieces[i], int
        )
        if fallback_byte or (len(raw) == 1 and raw[0] >= 0x80):
            ids_bytes.append(i)
        elif any(b >= 0x80 for b in raw):
            ids_multibyte.append(i)
        else:
            ids_plain.append(i)
    added = tok.get_added_tokens_decoder()
    special = sorted(i for i, t in added.items() if t.special)
    plain_added = sorted(i for i, t in added.items() if not t.special)
    text_ids = sorted({i for text in REAL_TEXTS for i in tok.encode(text).ids})
    pools = [
        ids_bytes,
        rng.sample(ids_multibyte, min(3000, len(ids_multibyte))),
        rng.sample(ids_plain, min(3000, len(ids_plain))),
        special[:50],
        plain_added[:50],
        text_ids,
    ]
    return tuple(tuple(p) for p in pools if p)


def _real_case(folder: Path) -> Case:
    path = folder / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    tok = Tokenizer.from_file(str(path))
    table = DetokenizerTable.build(tok, special_token_ids(tok))
    return Case(tok, table, _pools_for(table, tok))


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir: Path) -> Case:
    return _real_case(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def gemma3(gemma3_tokenizer_dir: Path) -> Case:
    return _real_case(gemma3_tokenizer_dir)


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer_dir: Path) -> Case:
    return _real_case(llama3_tokenizer_dir)


def _ids(case: Case, max_size: int = 30) -> st.SearchStrategy[list[int]]:
    return st.lists(
        st.sampled_from(case.pools).flatmap(st.sampled_from), min_size=0, max_size=max_size
    )


# --- real tokenizers -------------------------------------------------------------------------


def test_kinds(qwen3: Case, gemma3: Case, llama3: Case) -> None:
    assert qwen3.table.kind is DecoderKind.BYTE_LEVEL
    assert llama3.table.kind is DecoderKind.BYTE_LEVEL
    assert gemma3.table.kind is DecoderKind.SENTENCEPIECE
    assert gemma3.table.strip.start == 0  # Gemma 3's decoder has no Strip: spaces kept


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_real_text_roundtrip(name: str, request: pytest.FixtureRequest) -> None:
    case: Case = request.getfixturevalue(name)
    for text in REAL_TEXTS:
        ids = case.tokenizer.encode(text).ids
        chunks = _stream(case.table, ids)
        assert "".join(chunks) == _decode(case.tokenizer, ids)
        assert "\ufffd" not in "".join(chunks)
        _check_prefixes(case, ids, max_remainder=8)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_every_token_alone(name: str, request: pytest.FixtureRequest) -> None:
    """The per-token table agrees with decode on single tokens (a stride of the vocab plus
    every added token), with and without skipping specials."""
    case: Case = request.getfixturevalue(name)
    n = len(case.table.byte_pieces or case.table.sp_pieces)
    ids = [*range(0, n, 13), *case.tokenizer.get_added_tokens_decoder()]
    expected = case.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
    got = ["".join(_stream(case.table, [i])) for i in ids]
    assert got == expected
    raw = DetokenizerTable.build(case.tokenizer, ())
    expected = case.tokenizer.decode_batch([[i] for i in ids[::7]], skip_special_tokens=False)
    assert ["".join(_stream(raw, [i])) for i in ids[::7]] == expected


@given(data=st.data())
@SETTINGS
def test_qwen3_random_ids(qwen3: Case, data: st.DataObject) -> None:
    ids = data.draw(_ids(qwen3))
    assert "".join(_stream(qwen3.table, ids)) == _decode(qwen3.tokenizer, ids)
    # ByteLevel holds back at most one unfinished character (one U+FFFD in a prefix decode).
    _check_prefixes(qwen3, ids, max_remainder=1)


def test_a_lead_byte_and_a_continuation_it_cannot_take_are_not_held(qwen3: Case) -> None:
    """ED A1 would be a surrogate: decode says U+FFFD U+FFFD at once (hypothesis found it)."""
    assert _stream(qwen3.table, [169, 94]) == ["", "\ufffd\ufffd", ""]
    _check_prefixes(qwen3, [169, 94], max_remainder=1)


@given(data=st.data())
@SETTINGS
def test_llama3_random_ids(llama3: Case, data: st.DataObject) -> None:
    ids = data.draw(_ids(llama3))
    assert "".join(_stream(llama3.table, ids)) == _decode(llama3.tokenizer, ids)
    # an unfinished character is held back; when its bytes can never complete (e.g. ED A1,
    # a UTF-16 surrogate's prefix) decode shows each as U+FFFD, so two characters may wait
    _check_prefixes(llama3, ids, max_remainder=2)


@given(data=st.data())
@SETTINGS
def test_gemma3_random_ids(gemma3: Case, data: st.DataObject) -> None:
    ids = data.draw(_ids(gemma3))
    assert "".join(_stream(gemma3.table, ids)) == _decode(gemma3.tokenizer, ids)
    # A byte-fallback run is held whole until it ends.
    _check_prefixes(gemma3, ids, max_remainder=len(ids))


def test_gemma3_byte_run_is_atomic(gemma3: Case) -> None:
    v = gemma3.tokenizer.get_vocab()
    ni = [v["<0xE4>"], v["<0xBD>"], v["<0xA0>"]]
    detok = StreamingDetokenizer(gemma3.table)
    assert [detok.add(i) for i in ni] == ["", "", ""]
    assert detok.add(v["▁hi"]) == "你 hi"
    # An invalid run becomes one U+FFFD per byte, exactly as decode does.
    bad = [v["<0x41>"], v["<0xE4>"], v["▁hi"]]
    assert (
        "".join(_stream(gemma3.table, bad)) == _decode(gemma3.tokenizer, bad) == "\ufffd\ufffd hi"
    )
    assert "".join(_stream(gemma3.table, ni[:2])) == _decode(gemma3.tokenizer, ni[:2])


def test_utf8_hold_back_byte_level(qwen3: Case) -> None:
    ids = qwen3.tokenizer.encode("👩‍👩‍👧").ids
    assert len(ids) > 1
    detok = StreamingDetokenizer(qwen3.table)
    chunks = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(chunks) == "👩‍👩‍👧"
    assert all("\ufffd" not in c for c in chunks)
    # A dangling partial character becomes U+FFFD at flush, as decode would give.
    first = ids[0]
    partial = [i for i in ids if len(qwen3.table.token_bytes(i)) < 4 and i != first]
    if partial:
        detok = StreamingDetokenizer(qwen3.table)
        assert detok.add(partial[0]) == ""
        assert detok.flush() == _decode(qwen3.tokenizer, [partial[0]])


def test_unknown_and_skipped_ids(qwen3: Case) -> None:
    detok = StreamingDetokenizer(qwen3.table)
    im_end = qwen3.tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    assert detok.add(im_end) == ""
    assert detok.add(10**7) == ""  # padded model vocab beyond the tokenizer
    assert detok.flush() == ""
    assert qwen3.table.token_text(im_end) == "<|im_end|>"


# --- synthetic SentencePiece vocabularies (Strip, fallback decoders) ---------------------------

WORDS = ("▁", "▁▁", "▁hello", "▁wor", "ld", "x", "▁你", "好", "é", "▁▁▁", "▁a▁b", "\n")


def _sp_tokenizer(decoder: decoders.Decoder) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in WORDS:
        vocab[w] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoder
    tok.add_special_tokens(["<s>", "</s>"])
    tok.add_tokens(["<tool>", "▁▁added"])
    return tok


def _sp_case(decoder: decoders.Decoder) -> Case:
    tok = _sp_tokenizer(decoder)
    table = DetokenizerTable.build(tok, special_token_ids(tok))
    v = tok.get_vocab()
    byte_ids = tuple(
        v[f"<0x{b:02X}>"] for b in (0x20, 0x41, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x98, 0x80, 0xFF)
    )
    word_ids = tuple(v[w] for w in WORDS)
    special = (v["<s>"], v["</s>"], v["<tool>"], v["▁▁added"])
    return Case(tok, table, (byte_ids, word_ids, special))


def _sp_decoder(start: int, stop: int) -> decoders.Decoder:
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if start or stop:
        steps.append(decoders.Strip(" ", start, stop))
    return decoders.Sequence(steps)


@pytest.mark.parametrize("strip", [(0, 0), (1, 0), (2, 0)])
@given(data=st.data())
@SETTINGS
def test_sentencepiece_strip_random(strip: tuple[int, int], data: st.DataObject) -> None:
    case = _sp_case(_sp_decoder(*strip))
    assert case.table.kind is DecoderKind.SENTENCEPIECE
    ids = data.draw(_ids(case, max_size=20))
    assert "".join(_stream(case.table, ids)) == _decode(case.tokenizer, ids)
    _check_prefixes(case, ids, max_remainder=len(ids))


@given(data=st.data())
@SETTINGS
def test_sentencepiece_strip_stop_random(data: st.DataObject) -> None:
    case = _sp_case(_sp_decoder(1, 2))
    ids = data.draw(_ids(case, max_size=20))
    # tokenizers panics when start and stop cuts overlap; a word keeps them apart.
    words = {case.tokenizer.token_to_id(w) for w in ("▁hello", "ld", "x", "▁你", "é")}
    assume(any(i in words for i in ids))
    assert "".join(_stream(case.table, ids)) == _decode(case.tokenizer, ids)


def test_llama2_style_leading_space_only_at_start() -> None:
    case = _sp_case(_sp_decoder(1, 0))
    v = case.tokenizer.get_vocab()
    ids = [v["<s>"], v["▁hello"], v["▁wor"], v["ld"], v["</s>"], v["▁hello"]]
    chunks = _stream(case.table, ids)
    assert chunks == ["", "hello", " wor", "ld", "", " hello", ""]
    assert "".join(chunks) == _decode(case.tokenizer, ids) == "hello world hello"


@pytest.mark.parametrize(
    "decoder",
    [
        decoders.Metaspace(replacement="▁", prepend_scheme="always"),
        decoders.Metaspace(replacement="▁", prepend_scheme="never"),
        None,
    ],
)
@given(data=st.data())
@SETTINGS
def test_incremental_fallback_random(decoder: decoders.Decoder | None, data: st.DataObject) -> None:
    tok = _sp_tokenizer(_sp_decoder(0, 0))
    tok.decoder = decoder
    table = DetokenizerTable.build(tok, special_token_ids(tok))
    assert table.kind is DecoderKind.INCREMENTAL
    v = tok.get_vocab()
    pool = [v[w] for w in WORDS if w != "é"] + [v["<s>"], v["<tool>"]]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=20))
    assert "".join(_stream(table, ids)) == _decode(tok, ids)


@given(text=st.lists(st.sampled_from(REAL_TEXTS), max_size=4).map("".join))
@SETTINGS
def test_incremental_fallback_holds_partial_utf8(qwen3: Case, text: str) -> None:
    """Forced onto the fallback path, a byte-level vocabulary still streams whole characters."""
    table = DetokenizerTable(DecoderKind.INCREMENTAL, qwen3.tokenizer, qwen3.table.skip_ids)
    ids = qwen3.tokenizer.encode(text).ids
    chunks = _stream(table, ids)
    assert "".join(chunks) == _decode(qwen3.tokenizer, ids) == text
    assert all("\ufffd" not in c for c in chunks)
