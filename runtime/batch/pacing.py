"""Chunk pacing: how many prompt tokens a prefill chunk takes between decode steps.

With nothing decoding a chunk is a whole `prefill_chunk`. Otherwise it is sized so that
its step takes about `PREFILL_SHARE` decode steps; a chunk that rides in the decode
step's forward (runtime/cache/ragged.py) about `FUSED_SHARE`, at least `MIN_FUSED_CHUNK`
tokens. A chunk run apart pays a weight read of its own, so it takes at least
`MIN_PREFILL_CHUNK` tokens.

The sizes come from two running measurements: a plain decode step's time (the median
of the last few, taken only from steps that followed a plain step: one right after
prefill work also waits for that work's tail), and the prompt tokens' own rate (each
chunk's time less one decode step's: the fixed cost of a forward, mostly reading the
weights, which a step pays whatever its chunk). Steps of s decode steps give the
streams s times their gaps and the prompt at best s / (s - 1) times its time alone
(more where its tokens cost more in smaller chunks).
"""

from __future__ import annotations

import statistics
from collections import deque

from runtime.batch.layered_prefill import running_average

PREFILL_SHARE = 2.0  # a prefill chunk takes about this many decode steps' time...
# ...but no fewer tokens than this: every forward pays a fixed cost (reading the weights,
# on a CPU about one decode step), so tiny chunks would stretch a long prompt's TTFT
# several times over for little gain in the streams' inter-token latency
MIN_PREFILL_CHUNK = 64
# A chunk riding on a decode step shares its weight read, so the streams wait for the
# chunk's compute only: the step may take FUSED_SHARE decode steps. Smaller chunks would
# buy the streams little and stretch the prompt's time to first token.
FUSED_SHARE = 3.0
MIN_FUSED_CHUNK = 32
# a chunk's time less one decode step is its tokens' own time, but no less than this
# share of it (a first step measured long, or a step estimate that outweighs the chunk)
_MIN_OWN_SHARE = 0.25
_PLAIN_STEPS = 9  # plain decode steps the decode step's time is the median of


class ChunkPacing:
    """The scheduler's running measurements of its steps and chunks (module docstring)."""

    def __init__(self) -> None:
        self.decode_step_seconds = 0.0  # the median of the last plain decode steps
        self.prefill_rate = 0.0  # prompt tokens/s of recent chunks, fixed cost aside
        self.chunk_tokens = 0  # the size of the last prefill chunk
        self.settled = False  # the last step was a plain decode step, nothing else
        # the last plain decode steps' times: their median is the decode step's (one slow
        # step, the engine thread busy elsewhere, must not size every chunk after it)
        self._plain_steps: deque[float] = deque(maxlen=_PLAIN_STEPS)

    def decode_step(self, took: float) -> None:
        """A decode step without a chunk on it took `took` seconds: it counts when it
        followed a plain step, or when no step was measured yet."""
        if self.settled or self.decode_step_seconds <= 0:
            self._plain_steps.append(took)
            self.decode_step_seconds = statistics.median(self._plain_steps)

    def measured_chunk(self, tokens: int, took: float) -> None:
        """A chunk of `tokens` took `took` seconds, a forward's fixed cost included."""
        if tokens > 0 and took > 0:
            rate = tokens / self.own(took)
            self.prefill_rate = running_average(self.prefill_rate, rate)
            self.chunk_tokens = tokens

    def own(self, took: float) -> float:
        """A step's or chunk's time less one decode step: its prompt tokens' own time."""
        return max(took - self.decode_step_seconds, _MIN_OWN_SHARE * took)


def chunk_size(cap: int, step_seconds: float, prefill_rate: float, *, fused: bool) -> int:
    """The next chunk's tokens while others decode: at most `cap`; `fused`, it rides on
    the decode step. The rates are the scheduler's (a lockstep group's are rank 0's)."""
    if prefill_rate <= 0:
        return min(cap, 2 * MIN_PREFILL_CHUNK)
    share = FUSED_SHARE if fused else PREFILL_SHARE
    budget = (share - 1) * step_seconds  # the step's fixed cost is one decode step
    floor = MIN_FUSED_CHUNK if fused else MIN_PREFILL_CHUNK
    return max(min(cap, floor), min(cap, int(prefill_rate * budget)))
