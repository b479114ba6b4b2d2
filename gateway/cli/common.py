"""What the `mlx-gateway` commands share: the defaults and environment variables behind
their options, sizes, the addresses printed for clients, and how a model name becomes a
path and the id clients see. Commands import this module, never each other or main."""

from __future__ import annotations

import argparse
import ipaddress
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import templates
from gateway.cli.errors import CliError
from gateway.cli.store.store import Store
from gateway.core.exposure import is_loopback as is_loopback  # the commands use it from here
from gateway.core.settings import API_KEY_ENV, QUANTIZE_CHOICES, QUANTIZE_GROUPS, EngineSettings

DEFAULT_MODEL = "smollm2-135m"
ENV_PREFIX = "MLX_GATEWAY_"


# -- the environment behind the options ---------------------------------------------------
def env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(ENV_PREFIX + name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise CliError(f"${ENV_PREFIX}{name} must be a whole number, not {value!r}") from None


def env_bytes(name: str, default: int | None) -> int | None:
    value = os.environ.get(ENV_PREFIX + name, "").strip()
    if not value:
        return default
    try:
        return parse_bytes(value)
    except argparse.ArgumentTypeError as exc:
        raise CliError(f"${ENV_PREFIX}{name}: {exc}") from None


def parse_bytes(text: str) -> int:
    """'0', '512M', '4G', '1.5GiB' -> bytes."""
    units = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1] if s and s[-1] in "kmgt" else ""
    try:
        value = float(s[: len(s) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 0, 512M, 4G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a size cannot be negative")
    return int(value * units[unit])


KV_BITS = (8, 4)  # runtime.cache.KV_BITS: the CLI must not import the runtime for --help


def parse_kv_bits(text: str) -> int | None:
    """'8', '4' -> bits; 'none' (or empty) -> None: keys and values as computed."""
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if value.isdigit() and int(value) in KV_BITS:
        return int(value)
    raise argparse.ArgumentTypeError(f"not a KV cache width: {text!r} (8, 4 or none)")


def parse_quantize(text: str) -> str | None:
    """'q4', 'q8' -> that; 'none' (or empty) -> None: weights as the source stores them."""
    value = text.strip().lower()
    if value in ("", "none"):
        return None
    if value in QUANTIZE_CHOICES:
        return value
    raise argparse.ArgumentTypeError(f"not a weight quantization: {text!r} (q4, q8 or none)")


def parse_quantize_group(text: str) -> int:
    value = text.strip()
    if value.isdigit() and int(value) in QUANTIZE_GROUPS:
        return int(value)
    groups = ", ".join(map(str, QUANTIZE_GROUPS))
    raise argparse.ArgumentTypeError(f"not a quantization group size: {text!r} ({groups})")


# -- addresses ----------------------------------------------------------------------------
def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def connectable_host(host: str) -> str:
    """The address a client on this machine should dial for a bind address: an
    unspecified one (0.0.0.0, ::) becomes the loopback of its family, IPv6 gets brackets."""
    if host in ("", "*"):
        return "127.0.0.1"
    ip = _ip(host)
    if ip is None:
        return host  # a host name
    if ip.is_unspecified:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    return f"[{ip}]" if ip.version == 6 else str(ip)


def client_url(host: str, port: int) -> str:
    """The base URL to print for clients: always one they can connect to."""
    return f"http://{connectable_host(host)}:{port}/v1"


def check_bind(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """A bind beyond loopback without a key serves everyone who can reach the address:
    refused unless --allow-unauthenticated says so."""
    if api_key is not None or allow_unauthenticated or is_loopback(host):
        return
    raise CliError(
        f"refusing to listen on {host} without an API key: anyone who can reach this "
        f"machine could use the model. Set --api-key (or ${API_KEY_ENV}), listen on "
        "127.0.0.1, or pass --allow-unauthenticated (or "
        "$MLX_GATEWAY_ALLOW_UNAUTHENTICATED=1) to serve everyone."
    )


def bind_warning(host: str, api_key: str | None) -> str | None:
    if api_key is not None or is_loopback(host):
        return None
    return (
        f"mlx-gateway: WARNING: listening on {host} without an API key: anyone who can "
        f"reach this machine can use the model. Set --api-key or ${API_KEY_ENV}."
    )


# -- models -------------------------------------------------------------------------------
def requested_id(model: str) -> str:
    """The id `mlx-gateway serve --model MODEL` serves under: an alias or repo id as given;
    for a path, the file's name without its extension, or the folder's whole name (a folder
    such as `Qwen3.5-0.8B` has no extension to drop)."""
    path = Path(model).expanduser()
    if not path.exists():
        return model
    return path.name if path.is_dir() else path.stem


def resolve(name: str) -> tuple[Path, str]:
    """The model's path and the id clients see: an alias or repo id as given, else the
    file or folder name."""
    return Store().resolve(name), requested_id(name)


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The engine options of `serve` and `run`; an unknown parser or template family
    fails here, at startup."""
    import parsers  # imported on use: every parser's module, which --help never needs

    if args.parser and args.parser not in parsers.names():
        raise CliError(f"unknown --parser {args.parser!r}; known: {', '.join(parsers.names())}")
    families = sorted(templates.builtin_families())
    if args.template_family and args.template_family not in families:
        raise CliError(
            f"unknown --template-family {args.template_family!r}; known: {', '.join(families)}"
        )
    return EngineSettings(
        prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefix_cache_bytes=args.prefix_cache_bytes,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
        snapshot_interval=args.snapshot_interval,
        template_family=args.template_family,
        parser=args.parser,
        kv_bits=args.kv_bits,
        **drafting(args.speculative, args.draft_model),
    )


def drafting(speculative: str | None, draft: str | None) -> dict[str, Any]:
    """`--speculative` and `--draft-model` as EngineSettings fields: a draft model drafts
    unless another mode is named; "draft" needs one (resolved here: a name that is not
    downloaded yet is fetched at startup)."""
    mode = speculative or ("draft" if draft else "lookup")
    if mode == "draft" and not draft:
        raise CliError("--speculative draft needs a draft model: --draft-model MODEL")
    if draft and mode != "draft":
        raise CliError(f"--draft-model drafts with --speculative draft, not {mode}")
    return {"speculative": mode, "draft_model": resolve(draft)[0] if draft else None}


def http_get(url: str, key: str | None, timeout: float) -> tuple[int, bytes]:
    """GET a running gateway's JSON endpoint (the key as a bearer token): status and body,
    an HTTP error's too. Connection errors propagate (nothing listens there)."""
    headers = {"accept": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as err:
        return int(err.code), err.read()
