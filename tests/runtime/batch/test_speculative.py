"""Speculative decoding (runtime/batch/speculative.py, drafts.py) against the oracle of
decoding without it.

Drafts come from the request's predicted output (always right when it is the reference
output, so a drafter that never drafts or a verifier that never accepts fails here) and
from prompt lookup; wrong predictions exercise rejection and rewinding. Greedy and
seeded sampled outputs equal the ones decoding without speculation gives, for every
cache kind (a hybrid's recurrent layers keep their states at each verified position and
go back to the accepted one), alone and in a batch mixing drafting and plain rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from runtime.batch.drafts import PROBE_AFTER, Draft, DraftLength, Lookup
from runtime.batch.history import SharedHistory
from runtime.batch.speculative import SpecStats, plan_drafts
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.types import FinishReason, GenerationRequest, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tests.support.tiny_hybrid as tiny_hybrid
from tests.support.engine_kinds import KINDS, collect, folder_maker, prompt, together

# every cache kind, and a second hybrid (dense MLPs; qwen3_next's are MoE)
MODELS = {**KINDS, "qwen3_5": (tiny_hybrid, tiny_hybrid.VOCAB)}

# -- drafts ---------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_longest_recent_match() -> None:
    seq = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 0, 5, 6, 7]
    assert Lookup(seq).propose(3).tokens == (3, 4, 0)  # the latest "5 6 7", not the first
    assert Lookup([*seq, 8]).propose(2).tokens == (9, 1)  # "6 7 8" only once before
    assert Lookup([1, 2, 3, 4]).propose(4).tokens == ()  # nothing repeats
    short = Lookup([1, 2, 9, 1, 2])
    assert short.propose(8).tokens == (9, 1, 2)  # up to the end, never past it


def test_lookup_reads_a_copy_on_in_order() -> None:
    """Text copied from the context keeps being read from where the copy is, though the
    n-gram it ends with repeats later in the context (the latest match is elsewhere)."""
    context = [7, 8, 9, 1, 2, 3, 4, 10, 11, 12, 13, 1, 2, 3, 4, 20, 21, 22, 23]
    lookup = Lookup([*context, 7, 8, 9], output_at=len(context))
    assert lookup.propose(4).tokens == (1, 2, 3, 4)
    lookup.extend([1, 2, 3, 4])
    assert lookup.propose(3).tokens == (10, 11, 12)  # on from the copy, not (20, 21, 22)
    lookup.extend([10, 99])  # the copy went another way: a search again
    assert lookup.propose(2).tokens == ()
    fresh = Lookup([*context, 1, 2, 3, 4])
    assert fresh.propose(3).tokens == (20, 21, 22)  # with no copy under way: the latest


def test_lookup_follows_the_prediction_then_searches_it_first() -> None:
    # the output so far is the prediction's beginning: the rest of it is the draft
    lookup = Lookup([4, 1], prediction=[9, 1, 2, 3, 3])
    assert lookup.propose(3) == Draft((9, 1, 2), True)
    lookup.extend([9, 1])
    assert lookup.propose(8) == Draft((2, 3, 3), True)
    # it went another way (7): the latest matching n-gram in the prediction
    draft = Lookup([4, 1, 2, 7, 1, 2], prediction=[9, 1, 2, 3, 3], output_at=3).propose(2)
    assert draft.tokens == (3, 3) and draft.predicted
    grown = Lookup([4, 5])
    grown.extend([6, 4, 5])
    assert grown.propose(1).tokens == (6,) and not grown.propose(1).predicted


def _rows(n: int, length: DraftLength) -> list[Any]:
    """`n` rows whose text repeats (lookup finds a draft), as plan_drafts reads them."""
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 2
    out = SimpleNamespace(max_tokens=99, progress=SimpleNamespace(generated=[]))
    return [
        SimpleNamespace(lookup=Lookup(text), feed=[16], drafting=length, out=out) for _ in range(n)
    ]


def test_draft_length_follows_acceptance_and_the_step_cost() -> None:
    good, fair, bad = DraftLength(), DraftLength(accepted=0.85), DraftLength()
    for _ in range(6):
        good.observe(4, 4)
        bad.observe(4, 0)
    assert good.expected(8) > 6 and bad.expected(8) < 1.1
    stats = SpecStats()
    stats.ratio = 0.45  # beta(1) 0.31, beta(8) 0.78
    assert len(plan_drafts(_rows(1, good), stats)[0].tokens) >= 6  # one row: long drafts
    assert 0 < len(plan_drafts(_rows(1, fair), stats)[0].tokens) < 8
    assert not any(d.tokens for d in plan_drafts(_rows(1, bad), stats))  # nothing pays
    # eight rows: a token row costs nearly what the step did, and two tokens a row fit
    # the budget: at 85% acceptance they do not pay for the synchronous step
    assert not any(d.tokens for d in plan_drafts(_rows(8, fair), stats))
    for _ in range(PROBE_AFTER):
        bad.skip()
    assert bad.probing and plan_drafts(_rows(1, bad), stats)[0].tokens  # tries again


def test_shared_history_drafts_what_another_sequence_wrote() -> None:
    history = SharedHistory(max_tokens=40)
    history.add([1, 2, 3, 4, 5, 6, 7, 8])
    history.add([9, 9, 3, 4, 5, 60, 70])  # the latest occurrence of "3 4 5" wins
    assert history.propose(np.array([0, 3, 4, 5]), 2) == (60, 70)
    assert history.propose(np.array([6, 7, 8]), 3) == ()  # nothing followed it
    lookup = Lookup([42, 1, 2, 3], shared=history)  # no match in its own tokens
    assert lookup.propose(3) == Draft((4, 5, 6), False)
    for i in range(6):  # past the bound, the oldest sequences go
        history.add([100 + 10 * i + j for j in range(10)])
    assert history.tokens <= 40 and history.propose(np.array([3, 4, 5]), 2) == ()


# -- the engine -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory, MODELS)


def _engine(folder: Path, *, speculative: str, max_batch: int = 8) -> Engine:
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=max_batch, prefix_cache_bytes=64 * 1024**2,
        snapshot_interval=8, speculative=speculative,
    )  # fmt: skip
    runner = ModelRunner(load(folder), settings)
    # a tiny model's step is mostly Python: pin the cost model, so that rows draft
    runner.scheduler.speculation.stats.ratio = 0.1
    runner.scheduler.speculation.stats.sync = 0.0
    runner.scheduler.speculation.stats.measure = False
    engine = Engine(runner, max_queue=64)
    engine.start()
    return engine


def _verify_steps(engine: Engine) -> int:
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    return runner.scheduler.speculation.stats.steps


def _request(tokens: tuple[int, ...], n: int, **kw: Any) -> GenerationRequest:
    sampling = SamplingParams(**({"temperature": 0.0} | kw.pop("sampling", {})))
    return GenerationRequest(tokens, n, sampling, prefill_chunk=16, **kw)


def _plain(folder: Path, requests: Sequence[GenerationRequest]) -> list[list[int]]:
    engine = _engine(folder, speculative="off", max_batch=1)
    try:
        return [collect(engine.submit(r))[0] for r in requests]
    finally:
        engine.stop()


@pytest.mark.parametrize("name", list(MODELS))
def test_drafted_output_equals_decoding_without_drafts(
    name: str, folders: Callable[[str], Path]
) -> None:
    folder = folders(name)
    vocab = MODELS[name][1]
    looping = prompt(12, 40, vocab) * 4  # repeats: prompt lookup finds it
    base = [
        _request(prompt(30, 41, vocab), 40),
        _request(looping, 40),
        _request(prompt(9, 42, vocab), 24, sampling={"logprobs": True, "top_logprobs": 2}),
        _request(prompt(20, 43, vocab), 32, sampling={"temperature": 0.9, "seed": 5}),
    ]
    want = _plain(folder, base)
    # one token wrong: drafted, rejected and rewound; then the prediction is found again
    bad = next(t for t in range(3, vocab) if t != want[2][1])
    wrong = (want[2][0], bad, *want[2][2:])
    requests = [
        # the right prediction: every draft accepted
        GenerationRequest(**{**base[0].__dict__, "prediction": tuple(want[0])}),
        base[1],
        # a wrong prediction: drafts rejected and rewound
        GenerationRequest(**{**base[2].__dict__, "prediction": wrong}),
        GenerationRequest(**{**base[3].__dict__, "prediction": tuple(want[3])}),
        # a plain row in the same batch
        GenerationRequest(**{**base[1].__dict__, "speculative": False}),
    ]
    engine = _engine(folder, speculative="lookup")
    try:
        alone = [collect(engine.submit(r)) for r in requests]  # one at a time
        batched = together(engine, requests)
        steps = _verify_steps(engine)
    finally:
        engine.stop()
    expected = [want[0], want[1], want[2], want[3], want[1]]
    for i, ((tokens, done), ref) in enumerate(zip([*alone, *batched], expected * 2, strict=True)):
        which = f"request {i % len(requests)} {'batched' if i >= len(requests) else 'alone'}"
        assert tokens == ref, which
        assert done.reason in (FinishReason.LENGTH, FinishReason.STOP)
    assert steps > 0
    for tokens, done in (alone[0], batched[0], alone[3]):
        stats = done.stats
        assert stats.drafted_tokens > 0
        # the right prediction: every draft accepted, every token foreseen
        assert stats.accepted_tokens == stats.drafted_tokens
        assert stats.accepted_prediction_tokens == len(tokens)
        assert stats.rejected_prediction_tokens == 0
    for _, done in (alone[2], batched[2]):  # it had a token the output did not
        assert done.stats.rejected_prediction_tokens > 0
    assert alone[4][1].stats.drafted_tokens == 0  # speculative=False drafts nothing


@pytest.mark.parametrize("name", list(MODELS))
def test_rejected_drafts_are_rewound(
    name: str, folders: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drafter that is right but for one token in each draft: every verify step
    rejects, rewinds and corrects, alone and with other rows, and the output is still
    decoding's own."""
    folder = folders(name)
    vocab = MODELS[name][1]
    requests = [_request(prompt(16 + 3 * i, 60 + i, vocab), 30) for i in range(3)]
    want = _plain(folder, requests)
    by_prompt = {r.prompt_tokens: w for r, w in zip(requests, want, strict=True)}

    def propose(self: Lookup, k: int) -> Draft:
        seen = tuple(int(t) for t in self.tokens)
        prompt_len, ref = next((len(p), w) for p, w in by_prompt.items() if seen[: len(p)] == p)
        written = len(self) - prompt_len
        right = list(ref[written : written + k])
        if len(right) >= 2:  # the second token wrong (the first one is accepted)
            right[1] = (right[1] + 1) % vocab
        return Draft(tuple(right), False)

    monkeypatch.setattr(Lookup, "propose", propose)
    engine = _engine(folder, speculative="lookup", max_batch=1)
    try:
        alone = [collect(engine.submit(r)) for r in requests]
    finally:
        engine.stop()
    for (tokens, done), ref in zip(alone, want, strict=True):
        assert tokens == ref
        assert done.stats.drafted_tokens > done.stats.accepted_tokens > 0


def test_the_trie_mode_drafts_from_other_conversations(folders: Callable[[str], Path]) -> None:
    """A second conversation writing what a first one wrote drafts it (`trie`), where
    its own tokens hold nothing to copy; the output is decoding's own."""
    folder = folders("llama")
    req = _request(prompt(20, 70, KINDS["llama"][1]), 30)
    want = _plain(folder, [req])[0]
    for mode in ("lookup", "trie"):
        engine = _engine(folder, speculative=mode, max_batch=1)
        try:
            first = collect(engine.submit(req))
            second = collect(engine.submit(req))
        finally:
            engine.stop()
        assert first[0] == second[0] == want
        if mode == "trie":  # all of it found in the first conversation
            assert second[1].stats.accepted_tokens > first[1].stats.accepted_tokens
            assert second[1].stats.accepted_tokens >= len(want) // 2


def test_a_rejected_draft_crossing_a_stop_string_ends_where_decoding_does(
    folders: Callable[[str], Path],
) -> None:
    folder = folders("llama")
    vocab = KINDS["llama"][1]
    base = _request(prompt(25, 50, vocab), 30)
    want = _plain(folder, [base])[0]
    loaded = load(folder)
    text = loaded.tokenizer.decode(want[5:9])
    stopped = GenerationRequest(**{**base.__dict__, "stop_strings": (text,)})
    reference = _plain(folder, [stopped])[0]
    # the prediction runs past the stop string, and is wrong after it
    guess = (*want[:12], *prompt(20, 51, vocab))
    engine = _engine(folder, speculative="lookup")
    try:
        tokens, done = collect(
            engine.submit(GenerationRequest(**{**stopped.__dict__, "prediction": guess}))
        )
    finally:
        engine.stop()
    assert tokens == reference
    assert done.reason is FinishReason.STOP and done.stats.drafted_tokens > 0
