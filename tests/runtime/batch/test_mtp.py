"""Drafting with a model's multi-token-prediction head (runtime/batch/mtp.py,
runtime/models/mtp.py), on tiny DeepSeek-V3 (MLA, MoE), GLM-4.5 (GQA, MoE), Qwen3-Next
(hybrid, MoE) and Qwen3.5 (hybrid, dense) models with an MTP layer in their checkpoints'
layouts (tests/support/tiny_mtp.py).

Oracles: decoding without drafts (greedy, seeded and logprob rows write its tokens);
a head arranged to predict what the target writes, whose every draft must be accepted
(a drafter that never drafts, or a head's cache out of step with the row, fails there);
the head run once over the whole sequence from a fresh cache, against the row's cache
fed step by step and rewound after each draft, and against every draft of an engine's
rows (the prompt's prefill chunks, token or layered, feed the head: a head that saw
only the output drafts otherwise). The sampled distribution: test_mtp_sampling.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from runtime.batch.handle import RequestHandle, ThreadSink
from runtime.batch.mtp import MTPDrafter, MTPLookup
from runtime.batch.sequence import Seq
from runtime.engine import Engine
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.models.mtp import MTPModel
from runtime.types import FinishReason, GenerationRequest, SamplingParams

pytest.importorskip("torch")
pytest.importorskip("transformers")

import tests.support.tiny_models as tiny_models
from tests.support.engine_kinds import collect, prompt, together
from tests.support.tiny_mtp import TARGETS, make_tiny_mtp

NAMES = list(TARGETS)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Path]:
    made: dict[tuple[str, bool], Path] = {}

    def get(name: str, agree: bool) -> Path:
        if (name, agree) not in made:
            folder = tmp_path_factory.mktemp(f"{name}-{'agree' if agree else 'random'}")
            made[name, agree] = make_tiny_mtp(name, folder, agree=agree)
        return made[name, agree]

    return get


@pytest.fixture(scope="module")
def attending(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> a random target whose head's attention output is scaled up (its drafts
    hang on what it attends to)."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_mtp(name, tmp_path_factory.mktemp(f"{name}-attend"),
                                       attend=ATTEND)  # fmt: skip
        return made[name]

    return get


ATTEND = 40.0


def _engine(folder: Path, speculative: str) -> Engine:
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=8, prefix_cache_bytes=64 * 1024**2, snapshot_interval=8,
        speculative=speculative,
    )  # fmt: skip
    runner = ModelRunner(load(folder, mtp=speculative == "mtp"), settings)
    # a tiny model's step is mostly Python: pin the cost model (drafting counts as free)
    stats = runner.scheduler.speculation.stats
    stats.ratio, stats.sync, stats.measure = 0.1, 0.0, False
    engine = Engine(runner, max_queue=64)
    engine.start()
    return engine


def _request(tokens: tuple[int, ...], n: int, **sampling: Any) -> GenerationRequest:
    return GenerationRequest(
        tokens, n, SamplingParams(**({"temperature": 0.0} | sampling)), prefill_chunk=16
    )


def _runs(folder: Path, mode: str, requests: Sequence[GenerationRequest]) -> list[Any]:
    """Each request alone, then all together."""
    engine = _engine(folder, mode)
    try:
        alone = [collect(engine.submit(r)) for r in requests]
        return alone + together(engine, requests)
    finally:
        engine.stop()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_with_mtp_equals_decoding_without_drafts(
    name: str, folders: Callable[[str, bool], Path]
) -> None:
    """A random head: its drafts are mostly rejected and rewound; greedy, seeded and
    logprob rows write decoding's own tokens, alone and batched with a row that does
    not draft."""
    folder = folders(name, False)
    vocab = TARGETS[name][1]
    requests = [
        _request(prompt(30, 41, vocab), 30),
        _request(prompt(12, 42, vocab) * 3, 30),
        _request(prompt(20, 43, vocab), 24, temperature=0.9, seed=5),
        _request(prompt(9, 44, vocab), 20, logprobs=True, top_logprobs=2),
        GenerationRequest(**{**_request(prompt(14, 45, vocab), 20).__dict__, "speculative": False}),
    ]
    want = _runs(folder, "off", requests)
    got = _runs(folder, "mtp", requests)
    for (tokens, done), (ref, ref_done) in zip(got, want, strict=True):
        assert tokens == ref
        assert done.reason is ref_done.reason
    assert sum(done.stats.drafted_tokens for _, done in got) > 0
    assert got[4][1].stats.drafted_tokens == 0  # speculative=False drafts nothing


@pytest.mark.parametrize("name", NAMES)
def test_a_head_that_predicts_the_target_has_every_draft_accepted(
    name: str, folders: Callable[[str, bool], Path]
) -> None:
    """The head's argmax is the target's next token (tests/support/tiny_mtp.py): greedy
    rows draft, and every drafted token is accepted, alone and batched; a sampled row
    draws its drafts from the head's distribution and keeps them."""
    folder = folders(name, True)
    vocab = TARGETS[name][1]
    requests = [
        _request(prompt(30, 61, vocab), 40),
        _request(prompt(7, 62, vocab), 33),
        _request(prompt(16, 63, vocab), 40, temperature=0.7, top_k=5),  # no special token
    ]
    want = _runs(folder, "off", requests[:2])
    got = _runs(folder, "mtp", requests)
    for (tokens, _), (ref, _) in zip([*got[:2], *got[3:5]], want, strict=True):
        assert tokens == ref
    for i, (_, done) in enumerate(got):
        s = done.stats
        assert s.drafted_tokens > 0 and s.accepted_tokens > 0
        greedy = i % len(requests) < 2
        if greedy and done.reason is FinishReason.LENGTH:
            assert s.accepted_tokens == s.drafted_tokens


@pytest.mark.parametrize("name", NAMES)
def test_the_head_s_cache_follows_the_row_through_drafts(
    name: str, folders: Callable[[str, bool], Path]
) -> None:
    """Hidden states handed over in pieces, each draft's positions rewound: every draft
    is the one the head gives run once over the whole sequence from a fresh cache."""
    loaded = load(folders(name, False), mtp=True)
    model = loaded.model
    drafter = MTPDrafter(model)
    tokens = list(prompt(24, 71, TARGETS[name][1]))
    hidden = model.forward(mx.array(tokens)[None], model.make_caches())[0]
    row = MTPLookup(drafter, tokens[:5], (), 5, None)
    seen = 2  # the cache begins mid-sequence: rotary attention reads distances only
    for end in (5, 6, 9, 10, 16, 24):
        row.extend(tokens[len(row) : end])
        row.observe(seen, hidden[seen : end - 1])
        seen = end - 1
        assert row.ready
        drafted = row.propose(3).tokens
        assert drafted == _reference(drafter, hidden, tokens[:end], start=2, k=3)
        assert row.cache.offset == end - 1 - 2  # the drafted positions went again


def _reference(
    drafter: MTPDrafter, hidden: mx.array, tokens: list[int], *, start: int, k: int
) -> tuple[int, ...]:
    """The head over positions start..len-2 in one forward, then on its own output."""
    cache = drafter.model.mtp_cache()
    n = len(tokens)
    passed, logits = drafter.run(hidden[start : n - 1][None], mx.array(tokens[start + 1 :])[None],
                                 cache)  # fmt: skip
    out = []
    for _ in range(k):
        best: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        token = best[0]
        out.append(token)
        passed, logits = drafter.run(passed, mx.array([[token]]), cache)
    return tuple(out)


@pytest.mark.parametrize("name", NAMES)
def test_mtp_weights_are_loaded_only_to_draft_with(
    name: str, folders: Callable[[str, bool], Path]
) -> None:
    """Other modes drop them (no memory spent); `mtp` keeps them as the files have them
    (Qwen's norms stored as offsets from 1 get the 1), and their bytes count in the
    model's."""
    folder = folders(name, False)
    plain, kept = load(folder).model, load(folder, mtp=True).model
    names = set(_parameters(plain))
    assert not [k for k in names if k.startswith("mtp.")]
    heads = _parameters(kept)
    own = {k: v for k, v in heads.items() if k.startswith("mtp.")}
    assert own and set(heads) - set(own) == names
    assert isinstance(plain, MTPModel) and isinstance(kept, MTPModel)
    assert plain.mtp_head() is None and kept.mtp_head() is not None
    files = mx.load(str(folder / "model.safetensors"))
    assert isinstance(files, dict)
    if not name.startswith("qwen"):
        layer = f"model.layers.{kept.args.num_layers}."
        stored, offset = files[layer + "eh_proj.weight"], 0.0
        norm = files[layer + "enorm.weight"]
    else:
        stored, offset = files["mtp.fc.weight"], 1.0
        norm = files["mtp.pre_fc_norm_embedding.weight"]
    assert mx.array_equal(own["mtp.eh_proj.weight"], stored.astype(mx.float32))
    assert mx.allclose(own["mtp.enorm.weight"], norm.astype(mx.float32) + offset)


def _parameters(model: Any) -> dict[str, mx.array]:
    leaves = tree_flatten(model.parameters())
    assert isinstance(leaves, list)
    return dict(leaves)


def test_mtp_is_refused_where_a_model_has_none(
    folders: Callable[[str, bool], Path], tmp_path: Path
) -> None:
    """A model without MTP layers (its config names none) fails to load for `mtp`,
    naming it; so does a checkpoint whose config names them and whose files dropped
    them; and a runner asked for `mtp` on a model loaded without its head."""
    llama = tmp_path / "llama-tiny"
    llama.mkdir()
    tiny_models.make_tiny("llama", llama)
    tiny_models.write_tokenizer(llama, tiny_models.VOCAB)
    with pytest.raises(ValueError, match=r"llama-tiny: --speculative mtp.*no multi-token"):
        load(llama, mtp=True)
    dropped = tmp_path / "dropped"
    dropped.mkdir()
    source = folders("qwen3_next", False)
    for f in source.iterdir():
        (dropped / f.name).write_bytes(f.read_bytes())
    weights = mx.load(str(dropped / "model.safetensors"))
    assert isinstance(weights, dict)
    kept = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    mx.save_safetensors(str(dropped / "model.safetensors"), kept, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"dropped: --speculative mtp.*no multi-token"):
        load(dropped, mtp=True)
    with pytest.raises(ValueError, match="needs the model's multi-token-prediction layer"):
        ModelRunner(load(source), RunnerSettings(speculative="mtp"))


# -- the prompt's context ------------------------------------------------------------------

Drafted = list[tuple[tuple[int, ...], int, int, tuple[int, ...]]]


def _recording(monkeypatch: pytest.MonkeyPatch) -> Drafted:
    """Every draft the head makes: the row's tokens, its cache's first position, the
    positions it holds (fed and pending), and the drafted tokens."""
    seen: Drafted = []
    original = MTPDrafter.draft_rows

    def draft_rows(self: MTPDrafter, rows: Sequence[MTPLookup], counts: Sequence[int]) -> Any:
        before = [(tuple(int(t) for t in r.tokens), r.base, r.fed + r.waiting) for r in rows]
        drafts = original(self, rows, counts)
        seen.extend((*b, d.tokens) for b, d in zip(before, drafts, strict=True))
        return drafts

    monkeypatch.setattr(MTPDrafter, "draft_rows", draft_rows)
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_the_head_reads_the_prompt_and_a_restored_prefix_starts_its_cache(
    name: str, attending: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's prefill chunks (16 tokens each here) feed the head: at every draft its
    cache holds every position of the row but the newest, from 0, and the draft is the
    one the head gives run once over the whole sequence; the head that saw only the
    output drafts otherwise. The same prompt again restores a prefix from the trie,
    whose hidden states nobody has: the head's cache starts where it ends. Both outputs
    are decoding's own."""
    folder = attending(name)
    vocab = TARGETS[name][1]
    request = _request(prompt(40, 81, vocab), 24)
    shared = request.prompt_tokens[:28] + prompt(12, 82, vocab)
    later = _request(shared, 24)
    want = _runs(folder, "off", [request, later])[:2]
    seen = _recording(monkeypatch)
    engine = _engine(folder, "mtp")
    try:
        first = collect(engine.submit(request))
        count = len(seen)
        again = collect(engine.submit(later))
    finally:
        engine.stop()
    assert [first[0], again[0]] == [w[0] for w in want]
    reused = again[1].stats.cached_tokens
    assert 16 <= reused <= 28
    drafter = MTPDrafter(load(folder, mtp=True).model)
    model = drafter.model
    differs = 0
    for i, (tokens, base, held, drafted) in enumerate(seen):
        assert base == (0 if i < count else reused)
        assert base + held == len(tokens) - 1  # every position but the newest
        hidden = model.forward(mx.array(tokens)[None], model.make_caches())[0]
        k = len(drafted)
        assert drafted == _reference(drafter, hidden, list(tokens), start=base, k=k)
        if i < count and len(tokens) > len(request.prompt_tokens) + 1:  # from the output on
            own = _reference(drafter, hidden, list(tokens), start=len(request.prompt_tokens), k=k)
            differs += own != drafted
    assert count > 0 and len(seen) > count and differs > 0


def test_a_prompt_read_a_few_layers_a_step_feeds_the_head(
    attending: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a row that does not draft decodes, a prompt goes through the layers a few
    a step (runtime/batch/layered_prefill.py): its chunks' last layer's output, normed,
    feeds the head as a whole chunk's would. Drafts equal the head run once over the
    whole sequence, and the output is decoding's own."""
    folder = attending("glm4_moe")
    vocab = TARGETS["glm4_moe"][1]
    plain = GenerationRequest(**{**_request(prompt(6, 91, vocab), 40).__dict__,
                                 "speculative": False})  # fmt: skip
    read = _request(prompt(40, 92, vocab), 20)
    want = _runs(folder, "off", [read])[0][0]
    seen = _recording(monkeypatch)
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=4, prefix_cache_bytes=64 * 1024**2, snapshot_interval=8,
        speculative="mtp",
    )  # fmt: skip
    runner = ModelRunner(load(folder, mtp=True), settings)
    scheduler = runner.scheduler
    stats = scheduler.speculation.stats
    stats.ratio, stats.sync, stats.measure = 0.1, 0.0, False
    assert scheduler.layered
    scheduler._layer_pace.min_prompt = 8  # a 40-token prompt goes layer by layer
    runner.admit(RequestHandle(plain, ThreadSink()))
    for _ in range(3):
        runner.step()
    runner.admit(RequestHandle(read, ThreadSink()))
    rows: dict[int, Seq] = {}
    while not scheduler.idle:
        runner.step()
        for row in scheduler.running.rows:
            rows.setdefault(id(row.handle.request), row)
    runner.close()
    assert scheduler.stats.layered_steps > 0
    assert list(rows[id(read)].out.progress.generated) == want
    drafter = MTPDrafter(load(folder, mtp=True).model)
    model = drafter.model
    assert seen
    for tokens, base, held, drafted in seen:
        assert base == 0 and held == len(tokens) - 1
        hidden = model.forward(mx.array(tokens)[None], model.make_caches())[0]
        assert drafted == _reference(drafter, hidden, list(tokens), start=0, k=len(drafted))


# -- rows together; memory -----------------------------------------------------------------


def test_rows_draft_their_later_positions_in_one_forward_of_the_head(
    folders: Callable[[str, bool], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLM's head (a plain KV cache under the kernels' row attention) drafts the rows'
    later positions in one (B, 1) forward; every draft of the agreeing head is accepted
    and the outputs are decoding's own. The other heads (latent caches, gated attention)
    draft a row at a time."""
    assert [MTPDrafter(load(folders(n, True), mtp=True).model).together for n in NAMES] == [
        n == "glm4_moe" for n in NAMES
    ]
    folder = folders("glm4_moe", True)
    vocab = TARGETS["glm4_moe"][1]
    requests = [_request(prompt(9 + 5 * i, 100 + i, vocab), 30) for i in range(3)]
    want = _runs(folder, "off", requests)[3:]
    rows: list[int] = []
    original = MTPDrafter.run

    def run(self: MTPDrafter, hidden: mx.array, tokens: mx.array, cache: Any) -> Any:
        rows.append(hidden.shape[0])
        return original(self, hidden, tokens, cache)

    monkeypatch.setattr(MTPDrafter, "run", run)
    engine = _engine(folder, "mtp")
    try:
        got = together(engine, requests)
    finally:
        engine.stop()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(rows) >= 2
    for _, done in got:
        assert 0 < done.stats.accepted_tokens == done.stats.drafted_tokens


def test_the_head_s_caches_count_in_the_memory_budget(
    folders: Callable[[str, bool], Path],
) -> None:
    """A row's head cache (one layer's keys and values over its prompt and output),
    projected to its longest as the batch's own caches are, comes off what the trie may
    keep."""
    folder = folders("glm4_moe", True)
    settings = RunnerSettings(
        prefill_chunk=16, max_batch=4, prefix_cache_bytes=64 * 1024**2, snapshot_interval=8,
        speculative="mtp", cache_memory_bytes=32 * 1024**2,
    )  # fmt: skip
    runner = ModelRunner(load(folder, mtp=True), settings)
    scheduler = runner.scheduler
    request = _request(prompt(40, 110, TARGETS["glm4_moe"][1]), 400)
    runner.admit(RequestHandle(request, ThreadSink()))
    while not scheduler.running.rows:
        runner.step()
    runner.step()
    row = scheduler.running.rows[0]
    assert isinstance(row.lookup, MTPLookup)
    held = row.lookup.cache.nbytes
    projected = scheduler.speculation.held_bytes(scheduler.running.rows)
    assert 0 < held < projected
    per_token = held / row.lookup.cache.keys.shape[-2]  # type: ignore[attr-defined]
    assert projected == pytest.approx(per_token * (40 + 400), rel=1e-6)
    limit = settings.cache_memory_bytes - projected - scheduler.running.projected()
    assert scheduler.prefix.limit_bytes == limit
    runner.close()
