"""Asking a running gateway what it holds: `GET /admin/ps` (gateway/admin/ps.py) at
--host/--port with --api-key, found as `launch` finds it (the same options and
$MLX_GATEWAY_HOST, $MLX_GATEWAY_PORT, $MLX_GATEWAY_API_KEY). `ps` shows the answer; `rm`
reads it to refuse removing a model the server has loaded."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from gateway.cli.common import connectable_host, env, env_int, http_get
from gateway.cli.errors import FAILED, CliError

PS_PATH = "/admin/ps"


def add_server_options(p: argparse.ArgumentParser) -> None:
    """--host, --port and --api-key of the running gateway, as `launch` takes them."""
    p.add_argument("--host", default=env("HOST", "") or "127.0.0.1")
    p.add_argument("--port", type=int, default=env_int("PORT", 8000))
    p.add_argument(
        "--api-key",
        default=os.environ.get("MLX_GATEWAY_API_KEY") or None,
        help="the gateway's key (also $MLX_GATEWAY_API_KEY)",
    )


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    api_key: str | None

    @classmethod
    def of(cls, args: argparse.Namespace) -> Server:
        return cls(args.host, args.port, args.api_key)

    @property
    def root_url(self) -> str:
        return f"http://{connectable_host(self.host)}:{self.port}"


def loaded_models(server: Server, timeout: float = 5.0) -> dict[str, Any] | None:
    """The body of GET /admin/ps, or None when nothing listens at the address. A wrong
    or missing key, or something else answering, is a CliError that says what to do."""
    url = server.root_url + PS_PATH
    try:
        status, body = http_get(url, server.api_key, timeout)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    if status == 401:
        given = " (the one given was refused)" if server.api_key else ""
        raise CliError(
            f"the gateway at {server.root_url} wants an API key: pass --api-key or set "
            f"MLX_GATEWAY_API_KEY{given}",
            FAILED,
        )
    if status == 404:
        raise CliError(
            f"the server at {server.root_url} has no {PS_PATH}: an older mlx-gateway, or "
            "something else listens there; pick its --port",
            FAILED,
        )
    try:
        data = json.loads(body) if status == 200 else None
    except ValueError:
        data = None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise CliError(f"GET {url} answered {status}: {body[:200]!r}", FAILED)
    return data
