"""The draft model (runtime/batch/draft_model.py) and rejection sampling (runtime/batch/
rejection.py) against the oracles of decoding without drafts and of the target's own
distribution.

A draft model with the target's weights drafts what the target writes: every draft is
accepted (a drafter that never drafts, or caches that fall out of step with the row,
fail there), for every cache kind of the draft. Another random model's drafts are mostly
rejected, and the greedy and seeded outputs are decoding's own. With temperature, drafts
drawn from the draft's distribution keep the target's: the first two tokens' empirical
joint distribution over many requests matches the exact one (chi-square).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from runtime.batch.draft_model import draft_or_look_up
from runtime.batch.drafts import Draft, DraftLength, Lookup
from runtime.batch.handle import RequestHandle, ThreadSink
from runtime.batch.rejection import draws, judge, probabilities
from runtime.batch.sequence import Seq
from runtime.batch.speculative import SpecStats, plan_drafts, wants_drafts
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.types import FinishReason, GenerationRequest, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tests.support.tiny_hybrid as tiny_hybrid
import tests.support.tiny_models as tiny_models
from tests.support.engine_kinds import KINDS, collect, prompt, together

MODELS = {**KINDS, "qwen3_5": (tiny_hybrid, tiny_hybrid.VOCAB)}
VOCAB = tiny_models.VOCAB


def chi_square_limit(df: int) -> float:
    """The chi-square value a fit exceeds with probability 1e-3 (Wilson-Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Sequence[int], expected: Sequence[float]) -> tuple[float, int]:
    """The statistic and its degrees of freedom, bins expecting under 5 pooled."""
    small = [i for i, e in enumerate(expected) if e < 5]
    bins = [(counts[i], expected[i]) for i in range(len(expected)) if expected[i] >= 5]
    if small:
        bins.append((sum(counts[i] for i in small), sum(expected[i] for i in small)))
    return sum((c - e) ** 2 / e for c, e in bins if e > 0), len(bins) - 1


# -- rejection sampling -------------------------------------------------------------------


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Every position on its own: a token drawn from q, kept or replaced, is distributed
    as p, for distributions that overlap partly, not at all, and exactly."""
    rng = np.random.default_rng(0)
    n, vocab = 20000, 6
    p_row = np.array([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    cases = {
        "overlap": np.array([0.1, 0.1, 0.3, 0.3, 0.1, 0.1]),
        "disjoint": np.array([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]),
        "equal": p_row,
    }
    for name, q_row in cases.items():
        drafted = rng.choice(vocab, size=n, p=q_row)
        p = mx.array(np.tile(p_row, (n + 1, 1)), dtype=mx.float32)
        q = mx.array(np.tile(q_row, (n, 1)), dtype=mx.float32)
        accept, again = judge(p, q, drafted.tolist(), mx.random.key(7))
        kept = np.array(accept.tolist())
        out = np.where(kept, drafted, np.array(again.tolist())[:n])
        counts = np.bincount(out, minlength=vocab)
        stat, df = chi_square(counts.tolist(), (p_row * n).tolist())
        assert stat < chi_square_limit(df), (name, counts)
        if name == "equal":
            assert kept.all()  # p == q: nothing is rejected
        if name == "disjoint":
            assert not kept.any()


def test_the_distribution_is_what_the_sampler_draws_from() -> None:
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    top = np.array(probabilities(logits, SamplingParams(temperature=0.5, top_k=3)))[0]
    want = np.exp(np.array([2.0, 1.0, 0.5]) / 0.5)
    assert np.allclose(top[:3], want / want.sum(), atol=1e-6) and not top[3:].any()
    nucleus = np.array(probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7)))[0]
    assert (nucleus[:2] > 0).all() and not nucleus[2:].any()
    assert draws(SamplingParams(temperature=0.7, top_p=0.9))
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1),  # a seed: decoding's own tokens
        SamplingParams(temperature=0.7, logprobs=True),
        SamplingParams(temperature=0.7, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.7, repetition_penalty=1.2),
    ):
        assert not draws(params)


# -- the cost model ------------------------------------------------------------------------


class _Costly(Lookup):
    """Prompt lookup posing as a draft model: costly, and recording what it is asked."""

    costly = True

    def __init__(self, tokens: Sequence[int]) -> None:
        super().__init__(tokens)
        self.asked: list[int] = []

    def propose(self, k: int) -> Draft:
        self.asked.append(k)
        return super().propose(k)


def test_a_draft_model_s_cost_decides_whether_drafting_pays() -> None:
    """A drafted token costs the draft's forward: cheap drafts pay, a draft as costly as
    the target does not (the prior, the models' weight ratio, until measured); a draft
    model is asked for the length chosen, and the decision to verify drafts nothing."""
    text = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 2
    out = SimpleNamespace(max_tokens=99, progress=SimpleNamespace(generated=[]))
    row = SimpleNamespace(lookup=_Costly(text), feed=[16], drafting=DraftLength(0.9), out=out)
    stats = SpecStats(ratio=0.45, sync=0.0)
    rows: list[Any] = [row]
    asked = row.lookup.asked
    for prior, pays in ((0.02, True), (1.0, False)):
        stats.draft.prior = prior
        before = len(asked)
        assert wants_drafts(SimpleNamespace(rows=rows), stats) is pays  # type: ignore[arg-type]
        assert len(asked) == before  # judged without drafting
        drafted = plan_drafts(rows, stats)[0].tokens
        assert bool(drafted) is pays
        if pays:  # asked for the length chosen, no more
            assert asked[-1] == len(drafted) > 1
    stats.draft.prior = 0.0
    stats.plain, stats.draft.seconds = 0.1, 0.1  # measured: as costly as a plain step
    assert not plan_drafts(rows, stats)[0].tokens
    stats.draft.seconds = 0.002
    assert plan_drafts(rows, stats)[0].tokens


# -- the engine ---------------------------------------------------------------------------


def _make(root: Path, name: str, seed: int) -> Path:
    folder = root / f"{name}-{seed}"
    if not folder.exists():
        folder.mkdir()
        module, vocab = MODELS[name]
        module.make_tiny(name, folder, seed=seed)
        tiny_models.write_tokenizer(folder, vocab)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    root = tmp_path_factory.mktemp("drafts")
    return lambda name, seed: _make(root, name, seed)


def _engine(folder: Path, *, draft: Path | None, max_batch: int = 8) -> Engine:
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=max_batch, prefix_cache_bytes=64 * 1024**2,
        snapshot_interval=8, speculative="off" if draft is None else "draft",
    )  # fmt: skip
    runner = ModelRunner(load(folder), settings, draft=None if draft is None else load(draft))
    # a tiny model's step is mostly Python: pin the cost model (drafting counts as free)
    stats = runner.scheduler.speculation.stats
    stats.ratio, stats.sync, stats.measure = 0.1, 0.0, False
    engine = Engine(runner, max_queue=256)
    engine.start()
    return engine


def _runner(engine: Engine) -> ModelRunner:
    runner = engine._runner
    assert isinstance(runner, ModelRunner)
    return runner


def _request(tokens: tuple[int, ...], n: int, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        tokens, n, SamplingParams(**({"temperature": 0.0} | sampling)), prefill_chunk=16
    )


def _run(folder: Path, draft: Path | None, requests: Sequence[GenerationRequest]) -> list[Any]:
    engine = _engine(folder, draft=draft)
    try:
        return [collect(engine.submit(r)) for r in requests]
    finally:
        engine.stop()


@pytest.mark.parametrize("name", list(MODELS))
def test_a_draft_model_with_the_target_s_weights_has_every_draft_accepted(
    name: str, models: Callable[[str, int], Path]
) -> None:
    """Its caches stay in step with the row through every verify step's rewinds (its
    recurrent and sliding-window layers restore their states), alone and in a batch;
    a sampled row's drafts drawn from q = p are all accepted too."""
    folder = models(name, 3)
    vocab = MODELS[name][1]
    requests = [
        _request(prompt(30, 41, vocab), 40),
        _request(prompt(12, 42, vocab) * 3, 40),
        _request(prompt(20, 43, vocab), 32, temperature=0.8),
    ]
    want = _run(folder, None, requests[:2])
    engine = _engine(folder, draft=folder)
    try:
        alone = [collect(engine.submit(r)) for r in requests]
        batched = together(engine, requests)
        model = _runner(engine).scheduler.speculation.model
        assert model is not None
        reused = model.prefix.stats()["reused_tokens"]
    finally:
        engine.stop()
    for (tokens, _), (ref, _) in zip([*alone[:2], *batched[:2]], want * 2, strict=True):
        assert tokens == ref
    for i, (_, done) in enumerate([*alone, *batched]):
        s = done.stats
        # the sampled row draws without a seed: it may end at EOS before any step drafts
        # (3 tokens in one run); the greedy rows always write their 40
        assert s.drafted_tokens > 0 or (i % 3 == 2 and done.reason is FinishReason.STOP)
        if done.reason is FinishReason.LENGTH:  # (a row ending at EOS skips its draft's rest)
            assert s.accepted_tokens == s.drafted_tokens
    assert reused > 0  # the second run of each prompt: the draft's own trie held it


@pytest.mark.parametrize("name", list(MODELS))
def test_another_draft_model_leaves_decoding_s_output(
    name: str, models: Callable[[str, int], Path]
) -> None:
    """A different random model of the same kind: its drafts are mostly rejected, the
    greedy, seeded and logprob rows write decoding's own tokens, alone and together with
    a row that does not draft."""
    folder, draft = models(name, 3), models(name, 4)
    vocab = MODELS[name][1]
    requests = [
        _request(prompt(30, 51, vocab), 30),
        _request(prompt(12, 52, vocab) * 3, 30),
        _request(prompt(20, 53, vocab), 24, temperature=0.9, seed=5),
        _request(prompt(9, 54, vocab), 20, logprobs=True, top_logprobs=2),
        GenerationRequest(**{**_request(prompt(14, 55, vocab), 20).__dict__, "speculative": False}),
    ]
    want = _run(folder, None, requests)
    engine = _engine(folder, draft=draft)
    try:
        alone = [collect(engine.submit(r)) for r in requests]
        batched = together(engine, requests)
    finally:
        engine.stop()
    for (tokens, done), (ref, ref_done) in zip([*alone, *batched], want * 2, strict=True):
        assert tokens == ref
        assert done.reason is ref_done.reason
    drafted = sum(done.stats.drafted_tokens for _, done in alone)
    accepted = sum(done.stats.accepted_tokens for _, done in alone)
    assert drafted > accepted
    assert alone[4][1].stats.drafted_tokens == 0


def test_a_draft_model_with_another_vocabulary_is_refused(
    models: Callable[[str, int], Path], tmp_path: Path
) -> None:
    folder = models("llama", 3)
    other = tmp_path / "other"
    other.mkdir()
    for f in folder.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tiny_models.write_tokenizer(other, VOCAB - 24)  # fewer words: not the target's
    with pytest.raises(ValueError, match="tokenizer is not the target's"):
        ModelRunner(load(folder), RunnerSettings(speculative="draft"), draft=load(other))
    with pytest.raises(ValueError, match="needs a draft model"):
        ModelRunner(load(folder), RunnerSettings(speculative="draft"))


def _perturbed(folder: Path, out: Path, scale: float) -> Path:
    """A copy of `folder` with noise on every weight: a draft close to the target."""
    if not out.exists():
        out.mkdir()
        for f in folder.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
        for f in out.glob("*.safetensors"):
            weights = mx.load(str(f))
            assert isinstance(weights, dict)
            noisy = {
                k: v + scale * mx.random.normal(v.shape, key=mx.random.key(i)).astype(v.dtype)
                for i, (k, v) in enumerate(sorted(weights.items()))
            }
            mx.save_safetensors(str(f), noisy, metadata={"format": "pt"})
    return out


def _next(model: Any, seq: tuple[int, ...], params: SamplingParams) -> dict[int, float]:
    """The exact distribution of the token after `seq` (numpy on the logits: top-k)."""
    hidden = model.forward(mx.array(seq)[None], model.make_caches())
    logits = np.array(model.logits(hidden[:, -1, :]).astype(mx.float32).tolist()[0])
    top = np.argsort(-logits)[: params.top_k]
    w = np.exp((logits[top] - logits[top].max()) / params.temperature)
    return {int(t): float(v) for t, v in zip(top, w / w.sum(), strict=True)}


def test_sampled_drafts_keep_the_target_distribution(
    models: Callable[[str, int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Drafts drawn from a nearby model's distribution, checked by rejection sampling:
    the drafted token (the third: the first verify step comes after a plain one) is
    distributed as the target's next token, by its rank there and by whether the target
    likes it more than the draft (where a rejected draft's token is drawn again). A
    verifier that kept every draft, or drew again from p rather than max(p - q, 0),
    fails here."""
    folder = models("llama", 3)
    draft = _perturbed(folder, tmp_path / "near", 0.03)
    params = SamplingParams(temperature=1.0, top_k=4)
    tokens = prompt(12, 80, VOCAB)
    counter = iter(range(1, 1 << 30))  # every unseeded key, the rows' and the draft's
    monkeypatch.setattr(secrets, "randbits", lambda _: next(counter))
    n = 300
    engine = _engine(folder, draft=draft, max_batch=1)
    try:
        request = GenerationRequest(tokens, 4, params, prefill_chunk=16)
        runs = [collect(engine.submit(request))[0] for _ in range(n)]
        stats = _runner(engine).scheduler.speculation.stats
    finally:
        engine.stop()
    assert 0 < stats.accepted < stats.drafted  # accepted some, drew again for others
    target, near = load(folder).model, load(draft).model
    dists: dict[tuple[int, ...], tuple[dict[int, float], dict[int, float]]] = {}
    ranks, want_ranks = [0] * 4, [0.0] * 4
    liked, want_liked = 0, 0.0  # tokens the target gives more than the draft does
    for run in runs:
        seq = (*tokens, *run[:2])
        if seq not in dists:
            dists[seq] = (_next(target, seq, params), _next(near, seq, params))
        p, q = dists[seq]
        assert run[2] in p
        order = sorted(p, key=lambda t: -p[t])
        ranks[order.index(run[2])] += 1
        for r, t in enumerate(order):
            want_ranks[r] += p[t]
        more = {t for t in p if p[t] > q.get(t, 0.0)}
        liked += run[2] in more
        want_liked += sum(p[t] for t in more)
    stat, df = chi_square(ranks, want_ranks)
    assert stat < chi_square_limit(df), (ranks, want_ranks)
    stat, df = chi_square([liked, n - liked], [want_liked, n - want_liked])
    assert stat < chi_square_limit(df), (liked, want_liked)


def test_rows_draft_from_the_draft_model(models: Callable[[str, int], Path]) -> None:
    """A row of a drafting engine keeps a `ModelLookup` with caches of its own; when it
    leaves, what they held goes into the draft's trie and its caches are freed."""
    folder = models("llama", 3)
    engine = _engine(folder, draft=folder)
    try:
        collect(engine.submit(_request(prompt(40, 90, VOCAB), 12)))
        model = _runner(engine).scheduler.speculation.model
        assert model is not None
        assert model.prefix.stats()["adopted"] == 1 and not list(model._rows)
    finally:
        engine.stop()


# -- catching up a chunk a step; drafting together -----------------------------------------

CHUNK = 16  # the runner's prefill_chunk: the draft model's reading bound
Calls = list[tuple[tuple[int, ...], list[Any]]]


class _Counted:
    """The draft model, each forward's tokens' shape and caches recorded."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: Calls = []

    def forward(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        self.calls.append((tokens.shape, caches))
        return self.model.forward(tokens, caches)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.model.logits(hidden)


class _Stepped:
    """A runner stepped by hand, its rows kept as they join, with what each step did."""

    def __init__(self, folder: Path, draft: Path | None) -> None:
        settings = RunnerSettings(
            prefill_chunk=CHUNK, max_batch=4, prefix_cache_bytes=64 * 1024**2,
            snapshot_interval=8, speculative="off" if draft is None else "draft",
        )  # fmt: skip
        drafter = None if draft is None else load(draft)
        self.runner = ModelRunner(load(folder), settings, draft=drafter)
        speculation = self.runner.scheduler.speculation
        stats = speculation.stats
        stats.ratio, stats.sync, stats.measure = 0.1, 0.0, False
        self.runner.scheduler.layered = False  # the target's own prefill in token chunks
        self.counted: _Counted | None = None
        if speculation.model is not None:
            self.counted = _Counted(speculation.model.model)
            speculation.model.model = self.counted
            # a step's reading (and how far behind a row may be and still draft) as the
            # chunk, not as fast as this machine read the last one: the steps' shapes below
            # must not depend on the machine's load
            speculation.model._sized = lambda step_seconds: CHUNK  # type: ignore[method-assign]
        self.rows: dict[int, Seq] = {}  # by request, in admission order

    def admit(self, request: GenerationRequest) -> None:
        self.runner.admit(RequestHandle(request, ThreadSink()))

    def step(self) -> Calls:
        """One step; the draft model's forwards in it."""
        before = len(self.counted.calls) if self.counted is not None else 0
        self.runner.step()
        for row in self.runner.scheduler.running.rows:
            self.rows.setdefault(id(row.handle.request), row)
        return self.counted.calls[before:] if self.counted is not None else []

    def outputs(self) -> list[list[int]]:
        while not self.runner.scheduler.idle:
            self.step()
        self.runner.close()
        return [list(r.out.progress.generated) for r in self.rows.values()]


def test_a_long_prompt_s_draft_model_reads_a_chunk_a_step_while_the_others_decode(
    models: Callable[[str, int], Path],
) -> None:
    """A row joining with a long prompt reads it into the draft model's caches a chunk a
    step and drafts once it caught up: no forward of the draft model and no step's
    reading exceed the chunk, while the row beside it writes tokens every step (holding
    its drafts: a step commits as many columns for every row as the row that kept
    fewest). Then both draft, their later positions in one (2, 1) forward each, and
    every output is decoding's own."""
    folder = models("llama", 3)
    short = _request(prompt(6, 60, VOCAB), 300)
    long = GenerationRequest(  # the target reads it at once: the draft's reading shows
        prompt(300, 61, VOCAB), 60, SamplingParams(temperature=0.0), prefill_chunk=512
    )
    runs = []
    for draft in (folder, None):
        run = _Stepped(folder, draft)
        run.admit(short)
        for _ in range(3):
            run.step()
        run.admit(long)
        runs.append(run)
    run = runs[0]
    calls: Calls = []
    while len(run.rows) < 2:
        calls += run.step()
    first, second = run.rows.values()
    assert first.drafts.drafted > 0 and not second.drafts.drafted
    reading, drafted, wrote = 0, first.drafts.drafted, []
    while True:
        assert len(second.out.progress.generated) < long.max_tokens, "it never drafted"
        written = len(first.out.progress.generated)
        step = run.step()
        calls += step
        if second.drafts.drafted:
            break
        assert sum(math.prod(n) for n, _ in step) <= CHUNK  # a chunk a step in all
        assert first.drafts.drafted == drafted  # (it holds its drafts meanwhile)
        reading += 1
        wrote.append(len(first.out.progress.generated) - written)
    assert reading > 300 // CHUNK  # a step per chunk, at least
    # the other row wrote every step (a pipelined step's token is read at the next one)
    assert min(wrote[1:]) >= 1
    want = runs[1].outputs()
    both = 0  # steps in which both rows drafted: their later positions went together
    while not run.runner.scheduler.idle:
        before = [first.drafts.drafted, second.drafts.drafted]
        step = run.step()
        calls += step
        counts = [first.drafts.drafted - before[0], second.drafts.drafted - before[1]]
        if min(counts) > 0:  # a feed each, then one (2, 1) forward a later position
            assert len(step) == 2 + max(counts) - 1 and (2, 1) in [n for n, _ in step]
            both += 1
    assert both > 0
    assert max(math.prod(n) for n, _ in calls) <= CHUNK  # every forward of the draft
    assert second.drafts.accepted > 0 and first.drafts.drafted > drafted
    assert run.outputs() == want


def test_a_failing_drafter_s_rows_draft_by_prompt_lookup_from_then_on() -> None:
    """A draft model or MTP head whose forward raises: each of its rows is told (`fail`,
    after which it drafts by lookup) and drafts by lookup in this very step."""

    class Owner:
        def draft_rows(self, rows: Any, counts: Any) -> list[Draft]:
            raise RuntimeError("out of memory")

    class Row:
        def __init__(self, tokens: tuple[int, ...]) -> None:
            self.tokens, self.failed = tokens, False

        def fail(self) -> None:
            self.failed = True

        def propose(self, k: int) -> Draft:
            return Draft(self.tokens[:k])

    rows = [Row((1, 2, 3)), Row((4, 5))]
    drafts = draft_or_look_up(Owner(), rows, [2, 5], "the draft model")
    assert [d.tokens for d in drafts] == [(1, 2), (4, 5)]
    assert all(r.failed for r in rows)
