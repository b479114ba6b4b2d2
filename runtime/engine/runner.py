"""The loaded model's serving side: the scheduler's running batch, the shared prefix
cache, the grammar vocabulary, and the views the admin routes read.

`admit`, `step` and `abort` are called only from the engine's worker thread, the one
thread that owns MLX; `prefix_cache_view`, `cache_view` and `activity.view` from any
thread (the last two are frozen copies the worker publishes: runtime/engine/activity.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from runtime.backend import trim_heap
from runtime.batch import (
    DEFAULT_PREFILL_CHUNK,
    SPECULATIVE_MODES,
    DraftModel,
    MTPDrafter,
    Scheduler,
    SequenceOutput,
    check_vocabulary,
    weight_ratio,
)
from runtime.cache import KV_BITS, quantizing
from runtime.engine.activity import Activity
from runtime.engine.turns import Turns
from runtime.prefix import CacheReport, DiskTier, Lease, PrefixCache, TrieView, model_identity
from runtime.text import DetokenizerTable, GrammarVocabulary, Sampler, TokenMatcher
from runtime.types import Constraint, Finished, FinishReason

if TYPE_CHECKING:
    from runtime.batch import RequestHandle
    from runtime.load import LoadedModel

log = logging.getLogger(__name__)


def default_prefix_cache_bytes() -> int:
    """A fifth of physical memory: room for many paged-out conversations, and the
    model and live caches keep the rest."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 1024**3
    return int(total // 5)


def default_cache_memory_bytes() -> int:
    """Two fifths of physical memory for the batch and the trie together (the server
    sets it from its memory budget: gateway/core/models/memory.py)."""
    return 2 * default_prefix_cache_bytes()


DEFAULT_PREFIX_CACHE_DISK_BYTES = 8 * 1024**3
# the draft model's prefix trie and its rows' caches take this share of the cache memory
DRAFT_CACHE_SHARE = 1 / 8
DEFAULT_BUFFER_CACHE_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class RunnerSettings:
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefix_cache_bytes: int = field(default_factory=default_prefix_cache_bytes)
    # the prefix cache's disk tier (runtime/prefix/disk/tier.py): this model's directory, and
    # the most its files may take; None = state evicted from memory is dropped
    prefix_cache_dir: Path | None = None
    prefix_cache_disk_bytes: int = DEFAULT_PREFIX_CACHE_DISK_BYTES
    snapshot_interval: int = 1024
    max_batch: int = 8  # sequences decoding together; 1 serves one request at a time
    # the running batch's caches and the prefix trie's snapshots in memory share this:
    # a request whose batch would not fit waits, the trie gives way to the batch
    cache_memory_bytes: int = field(default_factory=default_cache_memory_bytes)
    # freed MLX buffers kept for reuse (process-wide). MLX keeps up to its memory limit
    # by default, so a server's resident memory followed its busiest moment, not its live
    # data; decode steps reuse far less than this, prefill chunks clear it anyway
    buffer_cache_bytes: int = DEFAULT_BUFFER_CACHE_BYTES
    # full-attention layers keep keys and values in 8 or 4 bits (runtime/cache/quantized.py);
    # None: as computed (lossless)
    kv_bits: int | None = None
    # whether sequences draft tokens and check them in one forward (runtime/batch/
    # speculative.py): "lookup" (from their own prompt and output), "trie" (and from what
    # other conversations wrote), "draft" (a draft model), "mtp" (the model's own MTP head:
    # load it with mtp=True), or "off" (a request's prediction still drafts)
    speculative: str = "lookup"

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ValueError(f"kv_bits must be one of {KV_BITS} or None, got {self.kv_bits}")


@dataclass(frozen=True)
class CacheView:
    """The prefix cache as the worker last published it."""

    at: float  # wall clock when it was taken
    stats: dict[str, int]
    pins: list[dict[str, object]]
    recent: list[CacheReport]
    trie: list[str]
    tree: TrieView


class ModelRunner:
    # a distributed group's lockstep runner (runtime/distributed/lockstep.py) brings
    # kinds of its own that take rank 0's decisions
    prefix_cache_type: type[PrefixCache[Any]] = PrefixCache
    scheduler_type: type[Scheduler] = Scheduler

    def __init__(
        self,
        loaded: LoadedModel,
        settings: RunnerSettings | None = None,
        draft: LoadedModel | None = None,
    ) -> None:
        """`draft`: the draft model of `speculative="draft"` (its tokenizer the target's)."""
        self.loaded = loaded
        self.settings = settings or RunnerSettings()
        self.draft = draft if self.settings.speculative == "draft" else None
        if self.settings.speculative == "draft" and draft is None:
            raise ValueError("speculative 'draft' needs a draft model")
        if draft is not None:
            check_vocabulary(loaded.tokenizer, draft.tokenizer)
        drafts = 0 if self.draft is None else _draft_bytes(self.settings)
        mx.set_cache_limit(self.settings.buffer_cache_bytes)
        tok = loaded.tokenizer
        self._detok_table = DetokenizerTable.build(tok.hf, tok.special_ids)
        # the build parses the tokenizer's whole JSON (Qwen2.5: 151k tokens and merges),
        # whose freed pieces the heap keeps otherwise (30-50 MB resident)
        trim_heap()
        # the model's caches, full-attention layers quantized with --kv-bits
        self.make_caches = quantizing(loaded.model.make_caches, self.settings.kv_bits)
        self.prefix: PrefixCache[Any] = self.prefix_cache_type(
            self.make_caches,
            budget_bytes=self.settings.prefix_cache_bytes,
            snapshot_interval=self.settings.snapshot_interval,
            disk=_disk_tier(loaded, self.settings),
        )
        self.prefix.set_limit(self.settings.cache_memory_bytes)
        # held while a request runs, so a dump from another thread sees a settled trie
        self.lock = threading.Lock()
        self._stream: Any = None
        self.turns: Turns | None = None  # the server's (take_turns)
        self._settled = self._settle()  # the view a busy engine answers with
        self.activity = Activity()  # the batch and the last requests, for the admin view
        self._grammar_vocab: GrammarVocabulary | None = None  # built on first use
        self.scheduler = self.scheduler_type(
            loaded.model,
            self.prefix,
            make_caches=self.make_caches,
            max_batch=self.settings.max_batch,
            prefill_chunk=self.settings.prefill_chunk,
            memory_bytes=self.settings.cache_memory_bytes - drafts,
            # not a bound method: no cycle
            on_begin=_on_begin(loaded.tokenizer, self.activity),
            speculative=self.settings.speculative,
        )
        if self.draft is not None:
            drafter = _draft_model(loaded, self.draft, self.settings, drafts)
            self.scheduler.speculation.attach(drafter)
        if self.settings.speculative == "mtp":  # the model was loaded with its MTP layer
            self.scheduler.speculation.attach_mtp(MTPDrafter(loaded.model))

    def grammar_vocabulary(self) -> GrammarVocabulary:
        """The model's vocabulary in the grammar engine, imported once (about 1.5 s for
        150k tokens) by the first constrained request."""
        if self._grammar_vocab is None:
            loaded = self.loaded
            self._grammar_vocab = GrammarVocabulary(
                loaded.tokenizer.hf.to_str(), loaded.model.args.vocab_size, loaded.eos_token_ids
            )
        return self._grammar_vocab

    def _matcher(self, constraint: Constraint | None) -> TokenMatcher | None:
        return None if constraint is None else self.grammar_vocabulary().matcher(constraint)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.loaded.tokenizer.decode(ids, skip_special_tokens=False)

    def _settle(self) -> CacheView:
        """Copy what the prefix-cache views show; the caller holds the lock."""
        p = self.prefix
        dump = p.dump().splitlines()
        return CacheView(time.time(), p.stats(), p.pins(), p.recent(), dump, p.view())

    @property
    def cache_view(self) -> CacheView:
        """The prefix cache as it was when a step last changed it (never waits)."""
        return self._settled

    def prefix_cache_view(self, wait_s: float = 0.25) -> dict[str, Any]:
        """The trie, its counters, the live pins and the last requests' cache reports
        (oldest first, token ids decoded). While a request runs (after `wait_s`), the
        view taken when the previous request finished, marked `busy`."""
        busy = not self.lock.acquire(timeout=wait_s)
        if busy:
            view = self._settled
        else:
            try:
                view = self._settle()
            finally:
                self.lock.release()
        return {
            "busy": busy,
            "as_of": view.at,
            "stats": view.stats,
            "pins": view.pins,
            "recent": [r.describe(self._decode) for r in view.recent],
            "trie": view.trie,
        }

    # -- the engine's side (runtime/engine/engine.py's BatchRunner) --

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    def has_room(self) -> bool:
        return self.scheduler.has_room()

    def admit(self, handle: RequestHandle) -> None:
        """Take a request into the scheduler; raises (the request fails) when it cannot
        run: no room in the context, a grammar that does not compile, bad sampling."""
        req = handle.request
        room = self.loaded.context_length - len(req.prompt_tokens)
        if room <= 0:
            raise ValueError(
                f"prompt of {len(req.prompt_tokens)} tokens leaves no room in the "
                f"{self.loaded.context_length}-token context"
            )
        if not req.prompt_tokens:
            raise ValueError("cannot generate from an empty prompt")
        vocab = self.loaded.model.args.vocab_size
        sampler = Sampler(req.sampling, vocab, req.prompt_tokens)
        matcher = self._matcher(req.constraint)  # a grammar that cannot compile fails here
        eos = self.loaded.eos_token_ids
        out = SequenceOutput(handle, self._detok_table, eos, min(req.max_tokens, room))
        self.scheduler.admit(handle, out, sampler, matcher)
        self.activity.admitted(handle, out)
        self.activity.publish(self.scheduler)

    def step(self) -> list[tuple[RequestHandle, Finished]]:
        """One scheduling step (a decode step for the batch, a prefill chunk)."""
        if self._stream is None:
            self._stream = mx.new_stream(mx.default_device())
        turns, stream = self.turns, self._stream
        with self.lock, mx.stream(stream):
            if turns is not None:  # an encoder's slice may run first (runtime/engine/turns.py)
                turns.before_step(id(self), lambda: mx.synchronize(stream))
            done = self.scheduler.step()
            if turns is not None:
                turns.after_step(id(self), busy=not self.scheduler.idle)
            if self.scheduler.idle:
                # a finished row's last step may still run on the device: let it end
                # here, not at interpreter exit
                mx.synchronize(self._stream)
            changed = self.scheduler.trie_changed or bool(done)
            if changed:
                self._settled = self._settle()
            self.activity.publish(self.scheduler, done, changed=changed)
        return done

    def abort(
        self, reason: FinishReason, error: str | None = None
    ) -> list[tuple[RequestHandle, Finished]]:
        with self.lock:
            ended = self.scheduler.abort(reason, error)
            self.activity.publish(self.scheduler, ended)
            if self.turns is not None:
                self.turns.leave(id(self))
            return ended

    def take_turns(self, turns: Turns) -> None:
        """Share the cores with the server's encoders: its steps come first, their work
        runs between them (runtime/engine/turns.py)."""
        self.turns = turns

    def close(self) -> None:
        """Release every MLX array the runner holds (the engine has stopped)."""
        with self.lock:
            self.scheduler.abort(FinishReason.CANCELLED, "server shutting down")
            self.scheduler.speculation.close()
            self.prefix.close()
            self._stream = None
            self.activity.clear()
            if self.turns is not None:
                self.turns.leave(id(self))

    def load(self) -> tuple[int, int, int, float]:
        s = self.scheduler.stats
        return s.running, s.prefilling, s.steps, s.decode_step_seconds


def _disk_tier(loaded: LoadedModel, settings: RunnerSettings) -> DiskTier | None:
    """The prefix cache's disk tier, when a directory is set and both caches have room.

    The identity covers what changes the cached state: the weights (files' names, sizes,
    mtimes), the dtype they were loaded in and the format they are held in (float,
    quantized at load, or as the file stores them), the device computing it, and the KV
    cache's bits (each layer's layout names them too: runtime/cache/codec.py)."""
    root = settings.prefix_cache_dir
    if root is None or settings.prefix_cache_bytes <= 0 or settings.prefix_cache_disk_bytes <= 0:
        return None
    # a lossless cache adds nothing: its files from before --kv-bits existed stay valid
    kv = () if settings.kv_bits is None else (f"kv_bits={settings.kv_bits}",)
    identity = model_identity(
        loaded.source,
        f"dtype={loaded.dtype}",
        f"weights={loaded.weight_format}",  # "float32", "q4g64", "gguf-native", ...
        f"device={mx.default_device()}",
        *kv,
    )
    return DiskTier.open(
        Path(root).expanduser(), max_bytes=settings.prefix_cache_disk_bytes, identity=identity
    )


def _draft_bytes(settings: RunnerSettings) -> int:
    """The draft model's share of the cache memory (its trie, bounded by the prefix
    cache's budget too, and its rows' caches)."""
    if settings.prefix_cache_bytes <= 0:
        return 0
    return min(settings.prefix_cache_bytes, int(settings.cache_memory_bytes * DRAFT_CACHE_SHARE))


def _draft_model(
    loaded: LoadedModel, draft: LoadedModel, settings: RunnerSettings, budget: int
) -> DraftModel:
    return DraftModel(
        draft.model,
        draft.model.make_caches,
        vocab=draft.model.args.vocab_size,
        target_vocab=loaded.model.args.vocab_size,
        budget_bytes=budget,
        snapshot_interval=settings.snapshot_interval,
        prefill_chunk=min(512, settings.prefill_chunk),
        prior=weight_ratio(draft.model, loaded.model),
    )


def _on_begin(tokenizer: Any, activity: Activity) -> Callable[[Lease[Any]], None]:
    """Tells the activity of each lease and logs its cache report at debug level, token
    ids decoded.

    The runner must not be reachable from its own scheduler: a reference cycle leaves it
    (and the model's arrays) to the garbage collector's last pass at interpreter exit,
    after MLX has shut down, which aborts the process."""

    def log_report(lease: Lease[Any]) -> None:
        activity.began(lease)
        if lease.report is not None and log.isEnabledFor(logging.DEBUG):
            line = lease.report.log_line(
                lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
            )
            log.debug("request %d: %s", lease.serial, line)

    return log_report
