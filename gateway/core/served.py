"""The model this server serves: loaded weights, its renderer and its engine."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.core.capabilities import Capabilities
from gateway.core.errors import InvalidRequest, NotFound

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.loader import LoadedModel
    from runtime.runner import ModelRunner
    from templates import Renderer


@dataclass
class ServedModel:
    id: str
    loaded: LoadedModel
    renderer: Renderer
    engine: Engine
    caps: Capabilities
    aliases: frozenset[str] = frozenset()
    runner: ModelRunner | None = None
    # the model's recommended sampling (generation_config.json / GGUF), for fields a
    # request leaves out: temperature, top_p, top_k, min_p, repetition_penalty
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.model.args.vocab_size)

    @property
    def vision(self) -> bool:
        return self.caps.vision

    def check_model(self, name: str) -> None:
        if name != self.id and name not in self.aliases:
            raise NotFound(
                f"The model {name!r} does not exist on this server; it serves {self.id!r}. "
                "Use that name or list models with GET /v1/models.",
                param="model",
                code="model_not_found",
            )

    def check_fits(
        self,
        prompt_tokens: int,
        max_tokens: int | None,
        *,
        prompt_cap: int | None = None,
        tokens_cap: int | None = None,
        tokens_param: str = "max_tokens",
        prompt_param: str = "messages",
    ) -> int:
        """Return the max_tokens to use, or refuse a request that cannot fit.

        `prompt_cap` and `tokens_cap` are the server's own limits on top of the context.
        """
        if tokens_cap is not None and max_tokens is not None and max_tokens > tokens_cap:
            raise InvalidRequest(
                f"{tokens_param} is too large: {max_tokens}. This server allows at most "
                f"{tokens_cap} completion tokens per request.",
                param=tokens_param,
                code="max_tokens_too_large",
            )
        if prompt_cap is not None and prompt_tokens > prompt_cap:
            raise InvalidRequest(
                f"The prompt is {prompt_tokens} tokens long; this server accepts at most "
                f"{prompt_cap} prompt tokens. Please reduce the length of the messages.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        ctx = self.context_length
        room = ctx - prompt_tokens
        if room <= 0 or (max_tokens is not None and max_tokens > room):
            asked = prompt_tokens + (max_tokens or 0)
            raise InvalidRequest(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{asked} tokens ({prompt_tokens} in the messages, {max_tokens or 0} in the "
                "completion). Please reduce the length of the messages or completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None:
            return max_tokens
        return room if tokens_cap is None else min(room, tokens_cap)
