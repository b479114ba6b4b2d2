"""`mlx-gateway ps`: the models a running gateway holds in memory, as `ollama ps` shows
them: one row each with its memory, keep-alive left, requests running and queued, and
its prefix cache's size; `--json` prints GET /admin/ps's body for scripts."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from gateway.cli.errors import FAILED, CliError
from gateway.cli.remote import Server, loaded_models

HEADERS = ("NAME", "STATE", "MEMORY", "KEEP ALIVE", "RUNNING", "QUEUED", "CACHE", "CONTEXT")


def human_bytes(n: object) -> str:
    if not isinstance(n, int) or isinstance(n, bool):
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"  # pragma: no cover - the loop returns at GB


def human_seconds(s: object) -> str:
    if not isinstance(s, (int, float)) or isinstance(s, bool):
        return "-"
    whole = int(s)
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    if whole >= 60:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole}s"


def _keep_alive(entry: Mapping[str, Any], keep_alive: object) -> str:
    left = entry.get("keep_alive_left_seconds")
    if left is not None:
        return human_seconds(left)
    if keep_alive == 0:
        return "forever"
    return "in use" if entry.get("state") == "loaded" else "-"


def _row(entry: Mapping[str, Any], keep_alive: object) -> tuple[str, ...]:
    cache = entry.get("prefix_cache")
    cache_bytes = cache.get("memory_bytes") if isinstance(cache, dict) else None
    return (
        str(entry.get("id")),
        str(entry.get("state")),
        human_bytes(entry.get("memory_bytes")),
        _keep_alive(entry, keep_alive),
        str(entry.get("requests_running", "-")),
        str(entry.get("requests_queued", "-")),
        human_bytes(cache_bytes),
        str(entry.get("context_length") or "-"),
    )


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, three spaces apart, as `ollama ps` prints them."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def render(body: Mapping[str, Any]) -> str:
    keep_alive = body.get("keep_alive_seconds")
    rows = [HEADERS, *(_row(e, keep_alive) for e in body["models"] if isinstance(e, dict))]
    return table(rows)


def ps(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    server = Server.of(args)
    body = loaded_models(server)
    if body is None:
        raise CliError(
            f"no gateway is running at {server.root_url}; start one with `mlx-gateway serve` "
            "(or give its --host/--port)",
            FAILED,
        )
    if args.json:
        out.write(json.dumps(body, indent=2) + "\n")
    else:
        out.write(render(body) + "\n")
    return 0
