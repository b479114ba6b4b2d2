"""What the HTTP side enforces (authentication, CORS, limits on what a client may ask)
and the engine settings a served model is built with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
API_KEY_ENV = "MLX_GATEWAY_API_KEY"
# The output bound of a request that sets none. Long enough for a reasoning model to
# think and then write a file-sized answer; short enough that a model stuck repeating
# itself (seen: greedy Qwen2.5-Coder-0.5B re-emitting a tool call toward its 32k context
# for most of an hour) lets go of the engine within minutes.
DEFAULT_MAX_TOKENS = 8192
# --quantize: a float model's weights quantized at load (runtime.load.QuantizeSpec; the CLI
# must not import the runtime for --help)
QUANTIZE_CHOICES = ("q4", "q8")
QUANTIZE_GROUPS = (32, 64, 128)
# --speculative: runtime.batch.SPECULATIVE_MODES, for the same reason
SPECULATIVE_CHOICES = ("off", "lookup", "trie", "draft", "mtp")
DEFAULT_QUANTIZE_GROUP = 64
# open connections served at once; beyond it a 503 with Retry-After (uvicorn's
# limit_concurrency, answered in the dialect): with --max-body-bytes, a bound on the
# memory bodies in flight can take
DEFAULT_MAX_CONNECTIONS = 1024
# requests rendering, tokenizing or fetching images at once, before the engine's queue;
# beyond it a 429 with Retry-After. A burst of 50 clients fits (tests/gateway/
# test_concurrency.py); the app gives anyio's thread pool this many threads and 8 more,
# so the model loader and the debug view always find one.
DEFAULT_MAX_PREPARING = 64
# --encoder-share: an encoder's share of the cores while a chat model has work
# (runtime.engine.turns.DEFAULT_SHARE; the CLI must not import the runtime for --help)
DEFAULT_ENCODER_SHARE = 0.25


@dataclass(frozen=True)
class ServerSettings:
    api_key: str | None = None  # None: no authentication
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API; "*" = any
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompt_tokens: int | None = None  # None: the model's context length
    max_tokens_cap: int | None = None  # None: whatever room the context leaves
    # the output bound of a request that sets none; None: what the context leaves
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    # True: a max_tokens over the context's room or the cap is a 400 (OpenAI's answer);
    # False: it is clamped, and the reply finishes with "length" when it gets there
    strict_max_tokens: bool = False
    keepalive_seconds: float = 10.0  # SSE comment interval while nothing else is sent
    retry_after_seconds: int = 2  # told to clients when the queue is full
    # the most a request body may take to arrive: a client that trickles it (slowloris)
    # gets a 408 and the connection closes, instead of holding it open for ever
    body_timeout_seconds: float = 60.0
    # the most a request's head (request line and headers) may take, from the connection
    # or its first byte: a 408 and the connection closes (gateway/server/head_deadline.py)
    head_timeout_seconds: float = 30.0
    # the address the server binds: which Host headers it answers depends on it
    # (gateway/core/exposure.py)
    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # more Host names (proxies, tunnels); "*" = any
    max_connections: int | None = DEFAULT_MAX_CONNECTIONS  # None: no bound
    max_preparing: int = DEFAULT_MAX_PREPARING

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("an API key cannot be empty")
        for name in (
            "max_body_bytes", "max_prompt_tokens", "max_tokens_cap", "default_max_tokens",
            "max_connections", "max_preparing",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.keepalive_seconds <= 0:
            raise ValueError("keepalive_seconds must be positive")
        if self.body_timeout_seconds <= 0 or self.head_timeout_seconds <= 0:
            raise ValueError("body_timeout_seconds and head_timeout_seconds must be positive")


@dataclass(frozen=True)
class EngineSettings:
    prefill_chunk: int = 2048
    max_batch: int = 8  # sequences decoding together; 1 = one request at a time
    max_queue: int = 64
    prefix_cache_bytes: int | None = None  # None = the runtime's default share of memory
    # the prefix cache's disk tier: a root holding one folder per model (None = none)
    prefix_cache_dir: Path | None = None
    prefix_cache_disk_bytes: int | None = None  # None = the runtime's default (8 GiB)
    snapshot_interval: int = 1024
    # what this server's models may take, weights and caches (None: no bound here) and
    # this model's cache memory, batch and trie (None: the runtime's default); a model
    # whose measured weights leave less room gets less (gateway/core/models/memory.py)
    memory_budget: int | None = None
    cache_memory_bytes: int | None = None
    template_family: str | None = None  # force a built-in renderer
    parser: str | None = None  # force an output parser
    # the engine's watchdog fails and restarts a worker with work but no step this long
    stall_seconds: float = 300.0
    # fetch image URLs on loopback, private and link-local hosts (default: public only)
    allow_private_urls: bool = False
    # full-attention layers keep keys and values in 8 or 4 bits (None: lossless)
    kv_bits: int | None = None
    # drafting tokens, checked in one forward: "lookup" (prompt lookup), "trie" (and other
    # conversations), "draft" (a draft model: `draft_model`), "mtp" (the model's own
    # multi-token-prediction layer, loaded only then) or "off" (a request's
    # predicted output drafts either way; runtime/batch/speculative.py)
    speculative: str = "lookup"
    # the draft model's folder or file (its tokenizer the served model's): "draft" only
    draft_model: Path | None = None
    # "q4" / "q8": a float source's weights quantized at load, in groups of quantize_group
    # (None: as the source stores them)
    quantize: str | None = None
    quantize_group: int = DEFAULT_QUANTIZE_GROUP

    def __post_init__(self) -> None:
        if self.speculative not in SPECULATIVE_CHOICES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_CHOICES}")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model drafts with speculative 'draft' (and it needs one)")
        if self.quantize is not None and self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES} or None")
        if self.quantize_group not in QUANTIZE_GROUPS:
            raise ValueError(f"quantize_group must be one of {QUANTIZE_GROUPS}")
