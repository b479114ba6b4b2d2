"""A loaded model: its weights, renderer and engine (gateway/core/models/registry.py
loads and unloads them)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.capabilities import Capabilities
from gateway.core.errors import InvalidRequest
from gateway.core.image_fetch import ImagePolicy
from templates import ControlStrings

if TYPE_CHECKING:
    from runtime.engine import Engine, ModelRunner
    from runtime.load import LoadedEncoder, LoadedModel
    from templates import Renderer

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    id: str
    # a generative model, or an encoder (caps.task "embed" or "rerank": its engine runs an
    # EncoderRunner; gateway/core/models/encoders.py builds it)
    loaded: LoadedModel | LoadedEncoder
    renderer: Renderer
    engine: Engine
    caps: Capabilities
    aliases: frozenset[str] = frozenset()
    runner: ModelRunner | None = None
    # the model's recommended sampling (generation_config.json / GGUF), for fields a
    # request leaves out: temperature, top_p, top_k, min_p, repetition_penalty
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
    image_policy: ImagePolicy = field(default_factory=ImagePolicy)  # limits, URL fetching
    # the tokenizer's control strings: in message text they are tokenized as plain text
    controls: ControlStrings = field(default_factory=ControlStrings)
    # an embedding model's Matryoshka sizes: the `dimensions` a request may ask for
    # besides the full size (a --config file's matryoshka_dimensions)
    embedding_dimensions: tuple[int, ...] = ()

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.model.args.vocab_size)

    @property
    def vision(self) -> bool:
        return self.caps.vision

    def check_fits(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_cap: int | None = None,
        tokens_cap: int | None = None,
        default: int | None = None,
        strict: bool = False,
        tokens_param: str = "max_tokens",
        prompt_param: str = "messages",
    ) -> int:
        """The number of tokens to generate at most, or refuse a request that cannot fit.

        `prompt_cap` and `tokens_cap` are the server's own limits on top of the context;
        `default` bounds a request that sets no max_tokens. A max_tokens beyond the room
        the context leaves (or the cap) is clamped, unless `strict` (OpenAI's 400).
        """
        if prompt_cap is not None and prompt_tokens > prompt_cap:
            raise InvalidRequest(
                f"The prompt is {prompt_tokens} tokens long; this server accepts at most "
                f"{prompt_cap} prompt tokens. Please reduce the length of the messages.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        ctx = self.context_length
        room = ctx - prompt_tokens
        if room <= 0:
            raise InvalidRequest(
                f"The prompt is {prompt_tokens} tokens; this model's context holds {ctx}, "
                f"so it is {1 - room} tokens over (a reply needs at least one). Shorten "
                f"the {prompt_param} (drop or summarise earlier turns, trim long tool "
                "results), or serve a model with a longer context.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        limit = room if tokens_cap is None else min(room, tokens_cap)
        if max_tokens is None:
            return limit if default is None else min(limit, default)
        if strict:
            self._check_strict(prompt_tokens, max_tokens, tokens_cap, tokens_param, prompt_param)
        elif max_tokens > limit:
            log.debug(
                "%s %d clamped to %d (context room %d)", tokens_param, max_tokens, limit, room
            )
        return min(max_tokens, limit)

    def _check_strict(
        self,
        prompt_tokens: int,
        max_tokens: int,
        tokens_cap: int | None,
        tokens_param: str,
        prompt_param: str,
    ) -> None:
        if tokens_cap is not None and max_tokens > tokens_cap:
            raise InvalidRequest(
                f"{tokens_param} is too large: {max_tokens}. This server allows at most "
                f"{tokens_cap} completion tokens per request.",
                param=tokens_param,
                code="max_tokens_too_large",
            )
        ctx = self.context_length
        if max_tokens > ctx - prompt_tokens:
            raise InvalidRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                f"or completion (this server runs with --strict-max-tokens; without it, "
                f"{tokens_param} is clamped to what the context leaves).",
                param=prompt_param,
                code="context_length_exceeded",
            )
