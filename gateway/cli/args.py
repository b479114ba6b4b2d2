"""The `mlx-gateway` command line: every command's options, their defaults from the
environment ($MLX_GATEWAY_*), and the one-line usage errors."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NoReturn

from gateway.cli.common import (
    DEFAULT_MODEL,
    env,
    env_bytes,
    env_int,
    parse_bytes,
    parse_kv_bits,
    parse_quantize,
    parse_quantize_group,
)
from gateway.cli.errors import CliError
from gateway.cli.launch import add_launch_parser
from gateway.cli.remote import add_server_options
from gateway.core.settings import (
    API_KEY_ENV,
    DEFAULT_ENCODER_SHARE,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_PREPARING,
    DEFAULT_MAX_TOKENS,
    SPECULATIVE_CHOICES,
)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MODEL_HELP = "alias, path, or Hugging Face repo id: org/name[@revision][:file.gguf]"
DISTRIBUTED_BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")
DEFAULT_DISTRIBUTED_TIMEOUT_S = 10.0


class Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line (the usage is in --help)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see `{self.prog} --help`)")


def _log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"not a log level: {text!r} (one of {', '.join(LOG_LEVELS)})"
        )
    return text.lower()


def build_parser() -> argparse.ArgumentParser:
    """The `mlx-gateway` parser, its subcommands and every option."""
    p: argparse.ArgumentParser = Parser(
        prog="mlx-gateway", description="Local LLM API server on MLX"
    )
    p.add_argument("--log-level", type=_log_level, default=env("LOG_LEVEL", "info"))
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over the OpenAI API")
    s.add_argument(
        "--model",
        action="append",
        default=None,
        help=MODEL_HELP + "; repeatable: several models, loaded on demand, the first the "
        f"default (default: $MLX_GATEWAY_MODEL, else {DEFAULT_MODEL})",
    )
    s.add_argument("--host", default=env("HOST", "127.0.0.1"))
    s.add_argument("--port", type=int, default=env_int("PORT", 8000))
    s.add_argument(
        "--model-id", default=None, help="name clients use (default: alias or file name)"
    )
    s.add_argument(
        "--model-alias",
        action="append",
        default=None,
        metavar="NAME",
        help="another model name to answer to (repeatable; e.g. the names Claude Code asks "
        "for; default: $MLX_GATEWAY_MODEL_ALIAS, comma-separated)",
    )
    _models_args(s)
    _engine_args(s)
    _server_args(s)
    _distributed_args(s)

    pull = sub.add_parser(
        "pull", help="download a model (an alias, or a Hugging Face repo into the Hub cache)"
    )
    pull.add_argument(
        "model", help="alias, or Hugging Face repo id: org/name[@revision][:file.gguf]"
    )
    sub.add_parser("list", help="list known and downloaded models")

    r = sub.add_parser("run", help="chat with a model in the terminal")
    r.add_argument("model", nargs="?", default=env("MODEL", DEFAULT_MODEL), help=MODEL_HELP)
    r.add_argument("prompt", nargs="?", default=None, help="one prompt, then exit")
    r.add_argument("--max-tokens", type=int, default=512)
    r.add_argument("--temperature", type=float, default=0.7)
    r.add_argument("--system", default=None, help="system message")
    _engine_args(r)

    add_launch_parser(sub)

    ps = sub.add_parser("ps", help="models a running gateway has loaded")
    ps.add_argument("--json", action="store_true", help="print GET /admin/ps's JSON")
    add_server_options(ps)
    show = sub.add_parser("show", help="what a downloaded model is (nothing is loaded)")
    show.add_argument("model", help=MODEL_HELP)
    show.add_argument("--json", action="store_true", help="print it as JSON")
    rm = sub.add_parser("rm", help="remove what `pull` stored for a model")
    rm.add_argument("model", help="alias, or Hugging Face repo id: org/name[@revision]")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask first")
    add_server_options(rm)
    return p


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill-chunk", type=int, default=env_int("PREFILL_CHUNK", 2048))
    p.add_argument("--max-queue", type=int, default=env_int("MAX_QUEUE", 64))
    p.add_argument(
        "--max-batch",
        type=int,
        default=env_int("MAX_BATCH", 8),
        help="sequences decoding together in one batched step (1 turns batching off)",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=parse_bytes,
        default=env_bytes("PREFIX_CACHE_BYTES", None),
        help="memory for paged-out conversation state (0 turns the prefix cache off; "
        "default: a fifth of RAM)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        type=Path,
        default=env("PREFIX_CACHE_DIR", "") or None,
        help="keep conversation state evicted from memory (and all of it at shutdown) on "
        "disk here, one folder per model, so it survives restarts "
        "(e.g. ~/.cache/mlx-gateway/prefix; default: no disk tier)",
    )
    p.add_argument(
        "--prefix-cache-disk-bytes",
        type=parse_bytes,
        default=env_bytes("PREFIX_CACHE_DISK_BYTES", None),
        help="most disk each model's prefix-cache folder may take; the least recently "
        "used state goes first (default 8G)",
    )
    p.add_argument(
        "--snapshot-interval",
        type=int,
        default=env_int("SNAPSHOT_INTERVAL", 1024),
        help="tokens between restore points inside long prompts",
    )
    p.add_argument(
        "--kv-bits",
        type=parse_kv_bits,
        default=env("KV_BITS", "none"),
        metavar="{8,4,none}",
        help="keep attention keys and values in 8 or 4 bits (about 3.5x / 6x less "
        "memory per token than float32, 1.9x / 3.5x less than bfloat16); the CPU reads "
        "them directly (default: $MLX_GATEWAY_KV_BITS, else none: as computed, lossless)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_CHOICES,
        default=env("SPECULATIVE", "") or None,
        help="draft the next tokens from the conversation itself (prompt lookup: what an "
        "agent writes back from a file it read), also from other conversations (trie), or "
        "with a draft model (draft) or the model's own multi-token-prediction layer (mtp: "
        "DeepSeek-V3, GLM-4.x, Qwen3-Next, Qwen3.5 checkpoints that ship it; its weights are "
        "loaded only then), and check them in one forward; the output is the same "
        "token for token (sampled: the same distribution), and a sequence stops drafting "
        "where it does not pay (default: $MLX_GATEWAY_SPECULATIVE, else draft with "
        "--draft-model, else lookup)",
    )
    p.add_argument(
        "--draft-model",
        default=env("DRAFT_MODEL", "") or None,
        metavar="MODEL",
        help="a small model with the served model's tokenizer that drafts for it "
        "(--speculative draft); its weights count in the memory budget "
        "(default: $MLX_GATEWAY_DRAFT_MODEL)",
    )
    p.add_argument(
        "--template-family",
        default=env("TEMPLATE_FAMILY", "") or None,
        help="render chats with this built-in template instead of the model's own "
        "(qwen3, qwen3-coder, qwen3.5, glm-4.7, gemma3, deepseek-v3.1, llama3, ...)",
    )
    p.add_argument(
        "--parser",
        default=env("PARSER", "") or None,
        help="read model output with this parser instead of the detected one "
        "(hermes, qwen3-coder, glm-4.7, deepseek-v3.1, llama3-json, think, passthrough)",
    )


def _models_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="the models to serve, in a TOML file of [[models]] tables (source, id, aliases, "
        "template_family, parser, context_length, sampling, kv_bits, quantize, quantize_group); "
        "instead of --model (default: "
        "$MLX_GATEWAY_CONFIG when no --model is given)",
    )
    p.add_argument(
        "--keep-alive",
        type=_seconds,
        default=env("KEEP_ALIVE", "1800"),
        help="unload a model idle this many seconds; the next request loads it again "
        "(default 1800; 0 = never)",
    )
    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=env_bytes("MEMORY_BUDGET", None),
        help="memory for loaded models' weights and caches (each model's running batch "
        "and prefix cache share what its weights leave; with several models at most a "
        "quarter of RAM each): a model that would not fit first unloads the least recently "
        "used idle ones (default: three quarters of RAM)",
    )
    p.add_argument(
        "--encoder-share",
        type=_share,
        default=env("ENCODER_SHARE", str(DEFAULT_ENCODER_SHARE)),
        metavar="FRACTION",
        help="the cores' time an embedding or rerank model gets while a chat model has work: "
        "they take turns, chat first, so streams keep their pace beside a large embedding "
        "request (default: $MLX_GATEWAY_ENCODER_SHARE, else 0.25; above 0, at most 1; 1 = no "
        "turns, the two compute at once and slow each other)",
    )
    p.add_argument(
        "--quantize",
        type=parse_quantize,
        default=env("QUANTIZE", "none"),
        metavar="{q4,q8,none}",
        help="quantize a float model's weights at load (a bf16/f16/f32 or FP8 safetensors "
        "folder, or an F16/BF16/F32 GGUF): its linear layers to 4 or 8 bits, the embeddings "
        "and output head to 8 bits under q4 (about 3.5x / 1.9x less memory than bfloat16); "
        "an already quantized model is refused (default: $MLX_GATEWAY_QUANTIZE, else none)",
    )
    p.add_argument(
        "--quantize-group",
        type=parse_quantize_group,
        default=env("QUANTIZE_GROUP", "64"),
        metavar="{32,64,128}",
        help="weights sharing one scale and bias under --quantize: smaller is closer to the "
        "float model and larger (default: $MLX_GATEWAY_QUANTIZE_GROUP, else 64)",
    )


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-private-urls",
        action="store_true",
        default=env("ALLOW_PRIVATE_URLS", "").lower() in ("1", "true", "yes", "on"),
        help="fetch image URLs on loopback, private and link-local hosts too (default: "
        "public hosts only, so a request cannot make the server reach its own network)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this key on every route but /health (also ${API_KEY_ENV})",
    )
    p.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        default=env("ALLOW_UNAUTHENTICATED", "").lower() in ("1", "true", "yes", "on"),
        help="serve on a --host other than loopback without --api-key (default: refused, "
        "since anyone who can reach the address could use the model)",
    )
    p.add_argument(
        "--allowed-hosts",
        default=env("ALLOWED_HOSTS", ""),
        help="comma-separated Host names to answer besides localhost, 127.0.0.1, [::1] and "
        "--host: a proxy's or a tunnel's ('*' = any; default none: a web page cannot reach "
        "the server by DNS rebinding)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=env_int("MAX_CONNECTIONS", DEFAULT_MAX_CONNECTIONS),
        help="open connections served at once; a request on one more gets a 503 with "
        f"Retry-After (default {DEFAULT_MAX_CONNECTIONS}; 0 = no bound)",
    )
    p.add_argument(
        "--max-preparing",
        type=int,
        default=env_int("MAX_PREPARING", DEFAULT_MAX_PREPARING),
        help="requests being rendered, tokenized or having images fetched at once, before "
        f"the engine's queue; more get a 429 with Retry-After (default {DEFAULT_MAX_PREPARING})",
    )
    p.add_argument(
        "--cors-origins",
        default=env("CORS_ORIGINS", ""),
        help="comma-separated browser origins allowed to call the API ('*' = any; default none)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default=env_bytes("MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
        help="largest request body accepted (413 above it; default 32M)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=env_int("MAX_PROMPT_TOKENS", None),
        help="longest prompt accepted, in tokens (default: the model's context)",
    )
    p.add_argument(
        "--max-tokens-cap",
        type=int,
        default=env_int("MAX_TOKENS_CAP", None),
        help="largest max_tokens a request may ask for (default: what the context leaves)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=env_int("DEFAULT_MAX_TOKENS", None),
        help=f"output bound of a request that sets none (default {DEFAULT_MAX_TOKENS}; "
        "0 = what the context leaves)",
    )
    p.add_argument(
        "--strict-max-tokens",
        action="store_true",
        default=env("STRICT_MAX_TOKENS", "").lower() in ("1", "true", "yes", "on"),
        help="refuse a max_tokens beyond the context's room or --max-tokens-cap with a 400, "
        "as OpenAI does (default: clamp it)",
    )
    p.add_argument(
        "--engine-stall-seconds",
        type=_seconds,
        default=env("ENGINE_STALL_SECONDS", "300"),
        help="fail the running requests (503) and restart the engine's worker when it makes "
        "no step this long while it has work (default 300: a CPU prefill chunk can be slow)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=_seconds,
        default=env("SHUTDOWN_GRACE", "30"),
        help="on SIGTERM/SIGINT, seconds the running generations get to finish before they "
        "are cancelled; new ones get 503 meanwhile, a second signal exits at once (default 30)",
    )


def _distributed_args(p: argparse.ArgumentParser) -> None:
    """`serve --distributed` (gateway/cli/serve/distributed.py)."""
    p.add_argument(
        "--distributed",
        choices=("tensor", "pipeline"),
        default=os.environ.get("MLX_GATEWAY_DISTRIBUTED") or None,
        help="serve one model split over the processes mlx.launch started (run this same "
        "command on every rank): tensor (heads and MLP columns split, all_sums per "
        "layer: fast links) or pipeline (contiguous stages of layers: slow links)",
    )
    p.add_argument(
        "--distributed-backend",
        choices=DISTRIBUTED_BACKENDS,
        default=os.environ.get("MLX_GATEWAY_DISTRIBUTED_BACKEND") or "any",
        help="the mx.distributed backend (default any: the one mlx.launch set up)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=float(
            os.environ.get("MLX_GATEWAY_DISTRIBUTED_TIMEOUT") or DEFAULT_DISTRIBUTED_TIMEOUT_S
        ),
        help="seconds a rank may stay silent (beyond a step's expected time) before the "
        f"group counts as lost: requests then get 503s (default {DEFAULT_DISTRIBUTED_TIMEOUT_S:g})",
    )


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, not {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError("seconds cannot be negative")
    return value
