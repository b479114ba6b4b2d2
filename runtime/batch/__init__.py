"""The running batch: the scheduler (admission, prefill interleaved with decode), chunk
pacing, prompt prefill, sequences, request handles, the single-sequence loop and
speculative decoding."""

from __future__ import annotations

from runtime.batch.draft_model import DraftModel, check_vocabulary, weight_ratio
from runtime.batch.drafts import SPECULATIVE_MODES
from runtime.batch.generate import DEFAULT_PREFILL_CHUNK, generate_tokens
from runtime.batch.handle import RequestHandle, ThreadSink, open_handle
from runtime.batch.mtp import MTPDrafter
from runtime.batch.pacing import FUSED_SHARE
from runtime.batch.prompt_prefill import keeps_on_the_way
from runtime.batch.scheduler import Scheduler, SchedulerStats
from runtime.batch.sequence import Seq, SequenceOutput
from runtime.batch.speculative import Speculation

__all__ = [
    "DEFAULT_PREFILL_CHUNK",
    "FUSED_SHARE",
    "SPECULATIVE_MODES",
    "DraftModel",
    "MTPDrafter",
    "RequestHandle",
    "Scheduler",
    "SchedulerStats",
    "Seq",
    "SequenceOutput",
    "Speculation",
    "ThreadSink",
    "check_vocabulary",
    "generate_tokens",
    "keeps_on_the_way",
    "open_handle",
    "weight_ratio",
]
