"""The prefix cache's disk tier (runtime/prefix/disk/tier.py, runtime/prefix/disk/files.py).

With greedy decoding, tokens are the same whether a prefix came from memory, from disk
or was computed: every request here is checked against the cache-off oracle. State
evicted under a tiny memory budget comes back from disk and reuses as much as a cache
with room for everything; a new cache on the same directory (a restart) hits on its
first request; truncated, corrupted and foreign files are skipped with one warning and
deleted; the directory stays within its byte bound; a write cut short leaves nothing
that loads. The cache kinds: KV, sliding window, recurrent (tests/support/recurrent_model.py),
and through the engine the real tiny architectures (llama, gemma3, qwen3_next,
deepseek_v3's MLA latents).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import runtime.prefix.disk.files as prefix_files
import runtime.prefix.disk.spill as prefix_spill
import runtime.prefix.disk.tier as prefix_disk
from gateway.cli.args import build_parser
from gateway.cli.common import engine_settings
from gateway.core.models.build import model_folder
from runtime.cache import KVCache, LatentCache, RecurrentCache, RotatingKVCache
from runtime.cache.codec import Encoded, decode, encode
from runtime.engine import Engine, RequestHandle
from runtime.engine.runner import ModelRunner, RunnerSettings
from runtime.load.loader import load
from runtime.prefix.cache import Key, PrefixCache, image_keys
from runtime.prefix.disk.files import SUFFIX, TMP_SUFFIX, model_identity
from runtime.prefix.disk.tier import DiskTier
from runtime.types import GenerationRequest, SamplingParams
from tests.runtime.prefix.test_prefix_cache import (
    KINDS,
    Oracle,
    check_snapshots,
    run_request,
    tracked_snapshots,
)
from tests.support.engine_kinds import KINDS as ENGINE_KINDS
from tests.support.engine_kinds import collect, folder_maker, prompt
from tests.support.recurrent_model import HybridModel

BIG = 10**9  # token ids below stay under the toy models' vocabulary of 256
IDENTITY = "tiny-model"
LOGGER = "runtime.prefix.disk.tier"


@pytest.fixture(scope="module")
def models() -> dict[str, HybridModel]:
    return {name: HybridModel(kinds, window=6, seed=7) for name, kinds in KINDS.items()}


@pytest.fixture(scope="module")
def oracles(models: dict[str, HybridModel]) -> dict[str, Oracle]:
    return {name: Oracle(model) for name, model in models.items()}


class Tiers:
    """Opens caches on directories and closes whatever a test left open."""

    def __init__(self) -> None:
        self.open: list[PrefixCache[Any]] = []

    def cache(
        self,
        model: HybridModel,
        directory: Path,
        *,
        budget: int = 1,  # a byte: every snapshot goes to disk
        disk_bytes: int = BIG,
        identity: str = IDENTITY,
        queue_bytes: int = prefix_disk.DEFAULT_QUEUE_BYTES,
    ) -> tuple[PrefixCache[Any], DiskTier]:
        tier = DiskTier.open(
            directory, max_bytes=disk_bytes, identity=identity, queue_bytes=queue_bytes
        )
        assert tier is not None
        pc = PrefixCache(
            model.make_caches, budget_bytes=budget, snapshot_interval=4, tail_keep=2, disk=tier
        )
        self.open.append(pc)
        return pc, tier


@pytest.fixture
def tiers() -> Iterator[Tiers]:
    made = Tiers()
    yield made
    for pc in made.open:
        pc.close()


def _memory(model: HybridModel) -> PrefixCache[Any]:
    return PrefixCache(model.make_caches, budget_bytes=BIG, snapshot_interval=4, tail_keep=2)


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*" + SUFFIX))


def _flip(path: Path, tensor: str) -> None:
    """Flip a byte in the middle of one tensor's data (safetensors: an 8-byte header
    length, the JSON header with each tensor's data offsets, then the data)."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + size])[tensor]["data_offsets"]
    data[8 + size + (start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _warnings(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == LOGGER and name in r.getMessage()
    ]


A: list[Key] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
B: list[Key] = [50, 51, 52, 53, 54, 55, 56, 57, 58]


def _session(pc: PrefixCache[Any], model: HybridModel, oracle: Oracle) -> list[int]:
    """A conversation, another, then the first again: the reuse of each request."""
    first = run_request(pc, model, oracle, A, 3)
    run_request(pc, model, oracle, B, 3)
    again = run_request(pc, model, oracle, [*A, *first.generated, 30, 31], 3)
    branch = run_request(pc, model, oracle, [*A[:7], 70, 71, 72], 2)
    return [first.reused, again.reused, branch.reused]


# -- memory -> disk -> memory --


@pytest.mark.parametrize("kind", list(KINDS))
def test_spilled_state_comes_back_from_disk(
    kind: str, models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers,
    tmp_path: Path,
) -> None:  # fmt: skip
    model, oracle = models[kind], oracles[kind]
    want = _session(_memory(model), model, oracle)
    pc, tier = tiers.cache(model, tmp_path)
    with tracked_snapshots() as created:
        assert _session(pc, model, oracle) == want  # tokens checked in run_request
        stats = pc.stats()
        assert stats["paged_bytes"] <= 1 and stats["disk_loads"] > 0 and stats["disk_writes"] > 0
        assert stats["snapshots"] == 0 and stats["disk_snapshots"] > 0
        pc.verify()
        check_snapshots(pc, created)  # every in-memory snapshot closed exactly once
    tier.flush()
    assert _files(tmp_path)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_restart_hits_on_its_first_request(
    kind: str, models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers,
    tmp_path: Path,
) -> None:  # fmt: skip
    model, oracle = models[kind], oracles[kind]
    memory = _memory(model)
    history = [*A, *run_request(memory, model, oracle, A, 4).generated, 40]
    want = run_request(memory, model, oracle, [*history, 41, 42], 3).reused
    # a roomy memory budget: the conversation is still in memory (and live) at close
    pc, _ = tiers.cache(model, tmp_path, budget=BIG)
    run_request(pc, model, oracle, A, 4)
    assert pc.stats()["disk_writes"] == 0
    pc.close()
    assert _files(tmp_path) and not list(tmp_path.glob("*" + TMP_SUFFIX))
    again, _ = tiers.cache(model, tmp_path, budget=BIG)
    assert again.stats()["disk_snapshots"] > 0
    assert run_request(again, model, oracle, [*history, 41, 42], 3).reused == want > 0
    again.verify()


def test_a_restart_after_spills_keeps_every_branch(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path
) -> None:
    model, oracle = models["recurrent"], oracles["recurrent"]
    pc, _ = tiers.cache(model, tmp_path)
    first = run_request(pc, model, oracle, A, 3)
    run_request(pc, model, oracle, B, 3)
    pc.close()
    again, _ = tiers.cache(model, tmp_path)
    assert run_request(again, model, oracle, [*B, 9, 9], 2).reused > 0
    assert run_request(again, model, oracle, [*A, *first.generated, 5], 2).reused > 0


def test_a_closed_cache_reopens_its_disk_tier(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path
) -> None:
    """The engine closes the runner after a failure and goes on with it: the next request
    finds the trie rebuilt from disk."""
    model, oracle = models["rotating"], oracles["rotating"]
    pc, tier = tiers.cache(model, tmp_path, budget=BIG)
    first = run_request(pc, model, oracle, A, 3)
    pc.close()
    assert tier.closed and pc.stats()["paged_bytes"] == 0
    assert run_request(pc, model, oracle, [*A, *first.generated, 7], 2).reused > 0
    assert not tier.closed
    pc.verify()


def test_image_keys_round_trip(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path
) -> None:
    model, oracle = models["plain"], oracles["plain"]
    cat: list[Key] = [1, 2, *image_keys("cat" * 8, 3), 5, 6, *image_keys("cat" * 8, 2), 7]
    dog: list[Key] = [1, 2, *image_keys("dog" * 8, 3), 5, 6, 8]
    pc, _ = tiers.cache(model, tmp_path)
    run_request(pc, model, oracle, cat, 2)
    pc.close()
    again, _ = tiers.cache(model, tmp_path)
    assert run_request(again, model, oracle, dog, 2).reused == 2  # the same ids, not the image
    assert run_request(again, model, oracle, [*cat, 9], 2).reused == len(cat)


# -- files that must not load --


def _three_files(
    model: HybridModel, oracle: Oracle, tiers: Tiers, directory: Path, identity: str = IDENTITY
) -> dict[int, Path]:
    """One file per conversation (plain caches, nothing shared): first token -> file."""
    pc, _ = tiers.cache(model, directory, budget=BIG, identity=identity)
    for first in (100, 110, 120):
        run_request(pc, model, oracle, [first, *range(first + 1, first + 7)], 2)
    pc.close()
    by_first: dict[int, Path] = {}
    for path in _files(directory):
        _, keys = prefix_files.read_header(path, identity)
        by_first[int(keys[0])] = path  # type: ignore[arg-type]
    assert sorted(by_first) == [100, 110, 120]
    return by_first


def test_bad_files_are_skipped_warned_and_deleted(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    model, oracle = models["plain"], oracles["plain"]
    files = _three_files(model, oracle, tiers, tmp_path)
    elsewhere = _three_files(model, oracle, tiers, tmp_path / "other", identity="another model")
    corrupt, truncated, kept = files[100], files[110], files[120]
    _flip(corrupt, "l1.1")  # inside a layer's values: only their checksum can tell
    truncated.write_bytes(truncated.read_bytes()[:-7])
    foreign = tmp_path / ("f" * 32 + SUFFIX)
    foreign.write_bytes(elsewhere[110].read_bytes())
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pc, tier = tiers.cache(model, tmp_path)
    for path in (truncated, foreign):
        assert len(_warnings(caplog, path.name)) == 1 and not path.exists()
    assert corrupt.exists() and not _warnings(caplog, corrupt.name)  # found when read
    prompt = [100, *range(101, 107), 2, 3]
    assert run_request(pc, model, oracle, prompt).reused == 0  # computed, not loaded
    assert len(_warnings(caplog, corrupt.name)) == 1
    assert "checksum" in _warnings(caplog, corrupt.name)[0]
    tier.flush()
    assert not corrupt.exists()
    assert run_request(pc, model, oracle, [110, *range(111, 117), 4]).reused == 0
    assert run_request(pc, model, oracle, [120, *range(121, 127), 4]).reused == 7  # intact
    assert kept.exists() or pc.stats()["disk_entries"] > 0
    assert pc.stats()["disk_bad_files"] == 3
    pc.verify()


def test_a_damaged_header_is_rejected_at_startup(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    model, oracle = models["plain"], oracles["plain"]
    path = _three_files(model, oracle, tiers, tmp_path)[100]
    text = path.read_bytes()
    at = text.index(b'"end":"') + len(b'"end":"')
    path.write_bytes(text[:at] + (b"8" if text[at : at + 1] != b"8" else b"9") + text[at + 1 :])
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pc, _ = tiers.cache(model, tmp_path)
    (message,) = _warnings(caplog, path.name)
    assert "checksum" in message and not path.exists()
    assert run_request(pc, model, oracle, [100, *range(101, 107), 1]).reused == 0


def test_a_write_cut_short_leaves_nothing_that_loads(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    model, oracle = models["plain"], oracles["plain"]
    files = _three_files(model, oracle, tiers, tmp_path)
    # a process killed mid-write leaves its temporary file (and, with a writer that
    # did not rename atomically, a short final file): neither may load
    whole = files[100].read_bytes()
    abandoned = files[100].with_name(files[100].name + TMP_SUFFIX)
    abandoned.write_bytes(whole[: len(whole) // 2])
    files[110].write_bytes(files[110].read_bytes()[:100])
    files[100].unlink()
    caplog.set_level(logging.WARNING, logger=LOGGER)
    pc, tier = tiers.cache(model, tmp_path)
    assert not abandoned.exists() and not files[110].exists()
    assert not _warnings(caplog, abandoned.name.removesuffix(TMP_SUFFIX) + TMP_SUFFIX)
    assert run_request(pc, model, oracle, [100, *range(101, 107), 1]).reused == 0
    assert run_request(pc, model, oracle, [110, *range(111, 117), 1]).reused == 0

    # a write that dies after part of the file: no final file appears, the state is
    # dropped from the trie (the request still gets the right tokens)
    def dies(tensors: Any, filename: str, metadata: Any) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("no space left on device")

    tier.flush()
    monkeypatch.setattr(prefix_files, "save_file", dies)
    before = set(_files(tmp_path))
    run_request(pc, model, oracle, [130, *range(131, 137)], 2)
    run_request(pc, model, oracle, [140, *range(141, 147)], 2)  # pages the first out
    tier.flush()
    assert set(_files(tmp_path)) == before and not list(tmp_path.glob("*" + TMP_SUFFIX))
    assert run_request(pc, model, oracle, [130, *range(131, 137), 5]).reused == 0
    pc.verify()
    assert _warnings(caplog, "no space left")


def test_renames_only_complete_fsynced_files(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    renamed: list[tuple[bool, bool]] = []
    synced: set[str] = set()
    real_replace, real_fsync = os.replace, prefix_files._fsync

    def fsync(path: Path) -> None:
        synced.add(str(path))
        real_fsync(path)

    def replace(src: Any, dst: Any) -> None:
        try:
            prefix_files.read_header(Path(src), IDENTITY)  # a complete, valid file
            complete = True
        except prefix_files.BadEntry:
            complete = False
        renamed.append((complete and str(src) in synced, Path(dst).exists()))
        real_replace(src, dst)

    monkeypatch.setattr(prefix_files, "_fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    _three_files(models["plain"], oracles["plain"], tiers, tmp_path)
    assert renamed and all(ok and not existed for ok, existed in renamed)
    assert str(tmp_path) in synced  # the directory entry too


# -- bounds --


def test_the_disk_lru_bound_holds(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path
) -> None:
    model, oracle = models["plain"], oracles["plain"]
    probe, probe_tier = tiers.cache(model, tmp_path / "probe")
    run_request(probe, model, oracle, [200, *range(201, 207)], 2)
    run_request(probe, model, oracle, [220, *range(221, 227)], 2)
    probe_tier.flush()
    one = max(p.stat().st_size for p in _files(tmp_path / "probe"))
    bound = 3 * one + one // 2  # room for three conversations' files
    pc, tier = tiers.cache(model, tmp_path / "lru", disk_bytes=bound)
    prompts = [[10 * i + 130, *range(10 * i + 131, 10 * i + 137)] for i in range(8)]
    outs = [run_request(pc, model, oracle, p, 2) for p in prompts]
    tier.flush()
    pc.verify()
    on_disk = sum(p.stat().st_size for p in _files(tmp_path / "lru"))
    assert on_disk <= bound and pc.stats()["disk_evictions"] > 0
    assert pc.stats()["disk_bytes"] == on_disk
    # the newest paged-out conversation is still there, the oldest went first
    assert run_request(pc, model, oracle, [*prompts[-2], *outs[-2].generated, 1]).reused > 0
    assert run_request(pc, model, oracle, [*prompts[0], *outs[0].generated, 1]).reused == 0


def test_a_full_writer_queue_drops_instead_of_waiting(
    models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    model, oracle = models["plain"], oracles["plain"]
    gate = threading.Event()
    real_write = prefix_files.write_entry

    def slow(*args: Any) -> Any:
        gate.wait(30)
        return real_write(*args)

    monkeypatch.setattr(prefix_spill, "write_entry", slow)
    pc, tier = tiers.cache(model, tmp_path, queue_bytes=1)  # one job at a time
    prompts = [[first, *range(first + 1, first + 7)] for first in (150, 160, 170, 180)]
    outs = [run_request(pc, model, oracle, p, 2) for p in prompts]
    assert pc.stats()["disk_dropped"] > 0  # the engine thread never waited on the disk
    pc.verify()
    # the first conversation's state is still in the queue (its write waits): it is
    # read from there; the second one's was dropped
    loads = pc.stats()["disk_loads"]
    assert run_request(pc, model, oracle, [*prompts[0], *outs[0].generated, 3]).reused == 8
    assert pc.stats()["disk_loads"] == loads + 1 and not _files(tmp_path)
    assert run_request(pc, model, oracle, [*prompts[1], *outs[1].generated, 3]).reused == 0
    gate.set()
    tier.flush()
    assert len(_files(tmp_path)) == pc.stats()["disk_writes"] >= 1


def test_one_process_per_directory(
    models: dict[str, HybridModel], tiers: Tiers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiers.cache(models["plain"], tmp_path)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert DiskTier.open(tmp_path, max_bytes=BIG, identity=IDENTITY) is None
    assert _warnings(caplog, "in use by another process")


# -- pieces --


def test_every_snapshot_kind_round_trips_through_a_file(tmp_path: Path) -> None:
    mx.random.seed(0)
    caches: list[Any] = [KVCache(), LatentCache(), RotatingKVCache(max_size=4)]
    for cache in caches:
        k = mx.random.normal((1, 1, 7, 8)).astype(mx.bfloat16)
        cache.update_and_fetch(k, k * 2)
    recurrent = RecurrentCache()
    recurrent.update(mx.random.normal((1, 3, 6)), mx.random.normal((1, 6)), 7)
    snaps = [cache.snapshot(2) for cache in [*caches, recurrent]]
    encoded: list[Encoded] = []
    for snap in snaps:
        assert snap is not None
        enc = encode(snap)
        assert enc is not None
        encoded.append(enc)
    metas = {
        i: prefix_files.LayerMeta(
            e.layout, e.base, e.floor, e.end,
            tuple(prefix_files.dtype_name(a) for a in e.arrays),
            tuple(tuple(a.shape) for a in e.arrays),
        )
        for i, e in enumerate(encoded)
    }  # fmt: skip
    views = {i: [prefix_files.export(a)[0] for a in e.arrays] for i, e in enumerate(encoded)}
    tokens, runs = prefix_files.encode_keys([*range(5), *image_keys("img", 2)])
    path = tmp_path / "entry.safetensors"
    written, size = prefix_files.write_entry(
        path, IDENTITY, prefix_files.Header(7, metas, 0, {}), tokens, runs, views
    )
    assert size == path.stat().st_size <= prefix_files.size_bound(tokens, runs, metas)
    header, keys = prefix_files.read_header(path, IDENTITY)
    assert header == written and keys == (*range(5), *image_keys("img", 2))
    arrays = prefix_files.read_layers(path, IDENTITY, header, range(4))
    for i, (snap, enc) in enumerate(zip(snaps, encoded, strict=True)):
        assert snap is not None
        back = decode(enc.layout, enc.base, enc.floor, enc.end, arrays[i])
        assert (back.base, back.floor, back.end) == (snap.base, snap.floor, snap.end)
        for x, y in zip(enc.arrays, arrays[i], strict=True):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item()
        with pytest.raises(ValueError):
            decode(enc.layout, enc.base + 1, enc.floor, enc.end, arrays[i])
    with pytest.raises(prefix_files.BadEntry, match="another model"):
        prefix_files.read_header(path, "another model")


def test_keys_round_trip_with_images() -> None:
    keys: list[Key] = [5, *image_keys("d1", 3), 7, *image_keys("d2", 2), *image_keys("d1", 1)]
    tokens, runs = prefix_files.encode_keys(keys)
    assert prefix_files.decode_keys(tokens, runs) == tuple(keys)
    plain, none = prefix_files.encode_keys([1, 2, 3])
    assert none == [] and plain.dtype == np.int32
    with pytest.raises(ValueError):
        prefix_files.encode_keys([1, -4])
    with pytest.raises(ValueError):
        prefix_files.encode_keys([2**31])


def test_model_identity_follows_the_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    (tmp_path / "README.md").write_text("notes")
    first = model_identity(tmp_path, "dtype=float32")
    (tmp_path / "README.md").write_text("other notes")
    assert model_identity(tmp_path, "dtype=float32") == first  # not a weight
    assert model_identity(tmp_path, "dtype=bfloat16") != first
    weights.write_bytes(b"x" * 11)
    assert model_identity(tmp_path, "dtype=float32") != first


def test_the_flags_reach_the_engine_settings(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["serve", "--prefix-cache-dir", str(tmp_path), "--prefix-cache-disk-bytes", "2G"]
    )
    settings = engine_settings(args)
    assert settings.prefix_cache_dir == tmp_path
    assert settings.prefix_cache_disk_bytes == 2 * 1024**3
    off = engine_settings(build_parser().parse_args(["serve"]))
    assert off.prefix_cache_dir is None and off.prefix_cache_disk_bytes is None
    assert model_folder(tmp_path, "Qwen/Qwen3-8B") == tmp_path / "Qwen--Qwen3-8B"
    assert model_folder(tmp_path, "..") == tmp_path / "model"


# -- through the engine, on the real tiny architectures --


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    return folder_maker(tmp_path_factory)


def _request(prompt: Sequence[int], new: int) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), new, SamplingParams(temperature=0.0), prefill_chunk=16)


def _engine(folder: Path, *, budget: int, directory: Path | None) -> tuple[Engine, ModelRunner]:
    settings = RunnerSettings(
        prefill_chunk=16,
        max_batch=2,
        prefix_cache_bytes=budget,
        snapshot_interval=8,
        prefix_cache_dir=directory,
        prefix_cache_disk_bytes=1 << 30,
    )
    runner = ModelRunner(load(folder), settings)
    engine = Engine(runner, max_queue=8)
    engine.start()
    return engine, runner


def _collect(handle: RequestHandle) -> tuple[list[int], int]:
    tokens, finished = collect(handle)
    assert finished.error is None
    return tokens, finished.stats.cached_tokens


def _prompt_for(i: int, results: list[tuple[list[int], int]], vocab: int) -> tuple[int, ...]:
    """A conversation, another, the first continued, then that continued again (each
    continuation builds on the previous reply)."""
    first = prompt(40, 11, vocab) + prompt(6, 1, vocab)
    if i == 1:
        return prompt(30, 2, vocab)
    if i == 0:
        return first
    second = first + tuple(results[0][0]) + prompt(5, 3, vocab)
    return second if i == 2 else second + tuple(results[2][0]) + prompt(4, 4, vocab)


def _run(
    folder: Path, vocab: int, *, budget: int, directory: Path | None, restarts: Sequence[int] = ()
) -> tuple[list[tuple[list[int], int]], list[dict[str, int]]]:
    """The four requests in turn, on a new engine before each of `restarts`; the tokens
    and cached tokens of each, and each engine's prefix-cache counters at its end."""
    results: list[tuple[list[int], int]] = []
    stats: list[dict[str, int]] = []
    engine, runner = _engine(folder, budget=budget, directory=directory)
    try:
        for i in range(4):
            if i in restarts:
                stats.append(runner.prefix.stats())
                engine.stop()  # the runner's close writes what memory holds
                engine, runner = _engine(folder, budget=budget, directory=directory)
            request = _request(_prompt_for(i, results, vocab), 8)
            results.append(_collect(engine.submit(request)))
        stats.append(runner.prefix.stats())
    finally:
        engine.stop()
    return results, stats


@pytest.mark.parametrize("name", list(ENGINE_KINDS))
def test_engine_spills_restores_and_restarts(
    name: str, folders: Callable[[str], Path], tmp_path: Path
) -> None:
    folder, vocab = folders(name), ENGINE_KINDS[name][1]
    computed, _ = _run(folder, vocab, budget=0, directory=None)  # every token computed
    tokens = [t for t, _ in computed]
    in_memory, _ = _run(folder, vocab, budget=BIG, directory=None)
    want = [c for _, c in in_memory]
    assert [t for t, _ in in_memory] == tokens and want[2] > 0 and want[3] > 0
    # a byte of memory: every paged-out state goes to disk and comes back from there
    spilled, (counts,) = _run(folder, vocab, budget=1, directory=tmp_path / "spill")
    assert [t for t, _ in spilled] == tokens and [c for _, c in spilled] == want
    assert counts["disk_writes"] > 0 and counts["disk_loads"] > 0
    # restarts before the third and the fourth request: the first request of each new
    # engine hits, on state paged out before the restart, then on the live conversation
    restarted, counts_each = _run(
        folder, vocab, budget=BIG, directory=tmp_path / "restart", restarts=(2, 3)
    )
    assert [t for t, _ in restarted] == tokens and [c for _, c in restarted] == want
    assert [c["disk_writes"] for c in counts_each] == [0, 0, 0]  # written only at close
    assert all(c["disk_loads"] > 0 for c in counts_each[1:])


@pytest.mark.parametrize("kind", ["plain", "recurrent"])
def test_a_lowered_limit_spills_to_disk_and_the_state_comes_back(
    kind: str, models: dict[str, HybridModel], oracles: dict[str, Oracle], tiers: Tiers,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The running batch lowers the trie's limit (runtime/batch/scheduler.py): what no longer
    fits goes to the disk tier at once, and later requests still reuse it."""
    model, oracle = models[kind], oracles[kind]
    want = _session(_memory(model), model, oracle)
    pc, _ = tiers.cache(model, tmp_path, budget=BIG)
    first = run_request(pc, model, oracle, A, 3)
    run_request(pc, model, oracle, B, 3)
    assert pc.stats()["paged_bytes"] > 0
    pc.set_limit(0)
    stats = pc.stats()
    assert stats["paged_bytes"] == 0 and stats["limit_bytes"] == 0 and stats["disk_snapshots"] > 0
    pc.set_limit(BIG)
    again = run_request(pc, model, oracle, [*A, *first.generated, 30, 31], 3)
    assert [first.reused, again.reused] == want[:2]
    assert pc.stats()["disk_loads"] > 0
    pc.verify()
