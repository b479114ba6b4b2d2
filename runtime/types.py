"""Leaf vocabulary of the runtime: frozen values passed between layers.

Imports nothing of ours and nothing of MLX, so the HTTP side can build these
without touching arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


def _empty_bias() -> Mapping[int, float]:
    return MappingProxyType({})


@dataclass(frozen=True)
class ReasoningBudget:
    """Close the reasoning block after `tokens` reasoning tokens: the sampler then emits
    `close_id` in place of whatever it drew. `inside` says the prompt leaves the model in
    the block; otherwise the block starts when the model emits `open_id`."""

    tokens: int
    close_id: int
    open_id: int | None = None
    inside: bool = False


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off
    repetition_penalty: float = 1.0  # HF semantics, over prompt + generated tokens
    presence_penalty: float = 0.0  # OpenAI semantics, over generated tokens
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=_empty_bias)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_budget: ReasoningBudget | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class PrefixPin:
    """Keep this request's prompt in the prefix cache ahead of unpinned entries for `ttl`
    seconds (Anthropic cache_control, OpenAI prompt_cache_key), while the byte budget
    allows. `key` names the client's cache group, for the debug view."""

    ttl: float = 300.0
    key: str | None = None


ReasoningLead = Literal["none", "open", "optional"]


@dataclass(frozen=True)
class Constraint:
    """A grammar the output must follow, token by token (runtime/text/constraints.py compiles
    it against the model's vocabulary).

    `grammar` is Lark text in llguidance's dialect whose `start` rule is the answer; a
    JSON schema is inlined as `start: %json {...}`, and `@name` refers to one of
    `parts`, (name, Lark text) pairs compiled as nested grammars. `reasoning` leaves a
    reasoning block free ahead of it: "open" when the prompt ends inside the block (the
    grammar starts after `think_close`), "optional" when the model may open one with
    `think_open`. `name` says where it came from, for error messages."""

    grammar: str
    parts: tuple[tuple[str, str], ...] = ()
    reasoning: ReasoningLead = "none"
    think_open: str = "<think>"
    think_close: str = "</think>"
    name: str = "grammar"


@dataclass(frozen=True)
class PromptImage:
    """An image in the prompt: its preprocessed pixels and where its placeholder span
    sits. The span's prompt tokens all hold the model's image token id; the prefix cache
    keys them by `digest`, a hash of the pixels, so different images never share state.
    `pixels` are float32, C-contiguous, of `shape` (channels, height, width)."""

    pixels: bytes = field(repr=False)
    shape: tuple[int, int, int]
    digest: str
    start: int  # offset of the span's first token in prompt_tokens
    length: int  # the span's tokens (the model's tokens per image)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as the engine sees it: tokens in, token events out."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    prefill_chunk: int | None = None  # None = the engine's default
    pin: PrefixPin | None = None  # keep the prompt's cached prefix ahead in eviction
    # where the prompt's messages start: restore points for layers that cannot rewind
    boundaries: tuple[int, ...] = ()
    constraint: Constraint | None = None  # a grammar every sampled token must keep to
    images: tuple[PromptImage, ...] = ()  # in prompt order, spans not overlapping
    # the output the client expects (OpenAI's Predicted Outputs), as tokens: drafted from
    # first; None: the engine's setting decides whether this request drafts at all
    prediction: tuple[int, ...] = ()
    speculative: bool | None = None


class FinishReason(str, Enum):
    STOP = "stop"  # EOS token or stop string
    LENGTH = "length"  # max_tokens or context limit
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's own text (may hold a partial UTF-8 sequence as U+FFFD)
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text for the client, already cleared of stop strings and broken UTF-8."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_bytes: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and checked
    accepted_tokens: int = 0  # of those, the ones the model wrote too
    accepted_prediction_tokens: int = 0  # of the prediction's tokens, the ones accepted
    rejected_prediction_tokens: int = 0  # the prediction's tokens that were not

    @property
    def prefill_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes out of prefill; decode speed counts the rest
        n = max(self.completion_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    stats: GenerationStats
    error: str | None = None
    stop_string: str | None = None  # which stop string ended it (reason STOP), if one did


GenerationEvent = TextDelta | Finished


@dataclass(frozen=True)
class EncodeInput:
    """One input to an encoder: its token ids, special tokens included; for a
    (query, document) pair, where the document's tokens (token type 1) begin."""

    tokens: tuple[int, ...]
    second_at: int | None = None


@dataclass(frozen=True)
class EncodeRequest(GenerationRequest):
    """Encode `inputs` with an encoder model (runtime/engine/encoder.py): one embedding or
    one relevance score each, nothing generated. It rides the engine's queue as a
    generation of no tokens (`EncodeRequest.of` fills those fields)."""

    inputs: tuple[EncodeInput, ...] = ()

    @classmethod
    def of(cls, inputs: tuple[EncodeInput, ...]) -> EncodeRequest:
        return cls(prompt_tokens=(), max_tokens=0, inputs=inputs)


@dataclass(frozen=True, eq=False)
class Encoded(Finished):
    """An encode request's end (reason STOP): `values` holds one float32 row per input
    (an embedding, or a cross-encoder's score as a row of one), in input order."""

    values: npt.NDArray[np.float32] | None = None
