"""GET /admin/state: what each loaded model's engine is doing, as one JSON document (the
browser page's engine and trie views read it, through GET /admin/events; so may any
dashboard). It holds what GET /debug/prefix-cache shows, and more.

Needs the key like every API route. `?model=NAME` keeps one model. Prompt text (the
`prompt` of recent requests, the `text` of trie nodes) is in only when the server has an
API key (the request carried it), or has none but is bound to a loopback address and the
client is on this machine: the rule /debug/* follows. `prompts_shown` says which.

    {
      "object": "admin.state",
      "as_of": 1718000000.5,            wall clock, seconds
      "prompts_shown": true,
      "keep_alive_seconds": 300.0,       idle seconds before an unload; 0: never
      "memory_budget_bytes": 25769803776,
      "models": [{                       each model loaded, loading or unloading
        "id": "qwen3", "state": "loaded",
        "idle_seconds": 1.2,             null while a request uses it
        "keep_alive_left_seconds": 298.8,   null: in use, or never unloads
        "max_batch": 8,                  rows that decode together
        "memory": {
          "counted_bytes":               what the model counts against the budget
          "weights_bytes":               its weights
          "cache_budget_bytes":          the bound its running batch and trie share
          "running_kv_bytes":            the running batch's caches now
          "running_kv_projected_bytes":  ... with every row at its longest
          "trie_memory_bytes":           the trie's snapshots in memory
          "trie_limit_bytes":            what the batch leaves them now
          "disk_bytes", "disk_budget_bytes"    the trie's disk tier (0 without one)
        },
        "queue": {"waiting": 0, "capacity": 64},   submitted, not yet taken in
        "batch": [{                      the prefill queue first, then the decoding rows
          "id": 7,                       this engine's number for the request
          "phase": "queued" | "prefill" | "decode",
          "prompt_tokens", "cached_tokens" (null until its prompt starts),
          "prefilled_tokens", "progress" (prefilled / prompt, 0..1),
          "generated_tokens", "max_tokens",
          "age_seconds", "ttft_seconds", "tokens_per_second" (prompt read, or generated),
          "drafted_tokens", "accepted_tokens"   speculative decoding's drafts, checked and kept
          "cache_request"                its cache report's number (debug/prefix-cache)
        }],
        "recent": [{                     the last requests that ended, oldest first
          "id", "cache_request", "prompt_tokens", "cached_tokens", "completion_tokens",
          "finish_reason", "error", "ttft_seconds", "tokens_per_second",
          "prefill_tokens_per_second", "ended_at" (wall clock),
          "drafted_tokens", "accepted_tokens",
          "cache": {"reason", "detail", "matched", "reused"} | null,
          "prompt": "...the prompt's last tokens"    (only when prompts are shown)
        }],
        "trie": {...} | null             gateway/admin/trie.py; null: no prefix cache
      }]
    }
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.admin.ps import model_entry
from gateway.admin.trie import Decode, trie_body
from gateway.core.exposure import is_loopback
from gateway.core.http import server_settings
from gateway.core.models import ModelRegistry, ModelState, ModelStatus, parameter_bytes
from gateway.core.with_model import registry_of
from runtime.engine import ActivityView, ModelRunner, RequestRecord, RowView
from runtime.prefix import CacheReport, keys_text

PROMPT_TAIL_TOKENS = 64  # of a recent request's prompt, shown


def shows_prompts(request: Request) -> bool:
    """Whether this client may read other requests' prompt text (the module docstring)."""
    settings = server_settings(request)
    if settings.api_key is not None:
        return True  # the key middleware let it in
    client = request.client
    return is_loopback(settings.host) and (client is None or is_loopback(client.host))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _cache(report: CacheReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    return {
        "reason": report.reason.value,
        "detail": report.detail(),
        "matched": report.matched,
        "reused": report.reused,
    }


def row_body(row: RowView) -> dict[str, Any]:
    return {
        "id": row.id,
        "phase": row.phase,
        "prompt_tokens": row.prompt_tokens,
        "cached_tokens": row.cached_tokens,
        "prefilled_tokens": row.prefilled_tokens,
        "progress": round(row.prefilled_tokens / max(1, row.prompt_tokens), 4),
        "generated_tokens": row.generated_tokens,
        "max_tokens": row.max_tokens,
        "age_seconds": round(row.age_seconds, 3),
        "ttft_seconds": _round(row.ttft_seconds),
        "tokens_per_second": _round(row.tokens_per_second, 1),
        "drafted_tokens": row.drafted_tokens,
        "accepted_tokens": row.accepted_tokens,
        "cache_request": None if row.cache is None else row.cache.serial,
    }


def record_body(record: RequestRecord, decode: Decode | None) -> dict[str, Any]:
    out = {
        "id": record.id,
        "cache_request": None if record.cache is None else record.cache.serial,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.completion_tokens,
        "finish_reason": record.finish_reason,
        "error": record.error,
        "ttft_seconds": _round(record.ttft_seconds),
        "tokens_per_second": round(record.tokens_per_second, 1),
        "prefill_tokens_per_second": round(record.prefill_tokens_per_second, 1),
        "ended_at": round(record.ended_at, 3),
        "drafted_tokens": record.drafted_tokens,
        "accepted_tokens": record.accepted_tokens,
        "cache": _cache(record.cache),
    }
    if decode is not None:
        prompt = record.keys[: record.prompt_tokens]
        out["prompt"] = keys_text(prompt[-PROMPT_TAIL_TOKENS:], decode) if prompt else None
    return out


def _memory(status: ModelStatus, runner: ModelRunner, activity: ActivityView) -> dict[str, Any]:
    settings = runner.settings
    budget = settings.cache_memory_bytes
    counted = status.size_bytes
    # a registry's model counts its measured weights plus its cache budget; a model
    # served as given was never measured
    weights = counted - budget if counted > budget else parameter_bytes(runner.loaded.model)
    stats = runner.cache_view.stats
    return {
        "counted_bytes": counted,
        "weights_bytes": weights,
        "cache_budget_bytes": budget,
        "running_kv_bytes": activity.batch_bytes,
        "running_kv_projected_bytes": activity.batch_projected_bytes,
        "trie_memory_bytes": stats.get("paged_bytes", 0),
        "trie_limit_bytes": stats.get("limit_bytes", 0),
        "trie_budget_bytes": stats.get("budget_bytes", 0),
        "disk_bytes": stats.get("disk_bytes", 0),
        "disk_budget_bytes": stats.get("disk_budget_bytes", 0),
    }


def model_state(status: ModelStatus, keep_alive: float, shown: bool) -> dict[str, Any]:
    """One model's part of the document (the module docstring)."""
    card = model_entry(status, keep_alive)
    out: dict[str, Any] = {
        "id": card["id"],
        "state": card["state"],
        "idle_seconds": card["idle_seconds"],
        "keep_alive_left_seconds": card["keep_alive_left_seconds"],
        "max_batch": None,
        "memory": None,
        "queue": None,
        "batch": [],
        "recent": [],
        "trie": None,
    }
    served = status.served
    runner = None if served is None else served.runner
    if served is None or runner is None:
        return out
    tokenizer = served.loaded.tokenizer

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    text = decode if shown else None
    activity = runner.activity.view
    out["max_batch"] = runner.settings.max_batch
    out["memory"] = _memory(status, runner, activity)
    out["queue"] = {"waiting": status.queue_depth, "capacity": served.engine.capacity}
    out["batch"] = [row_body(r) for r in activity.rows]
    out["recent"] = [record_body(r, text) for r in activity.recent]
    if runner.prefix.enabled:
        out["trie"] = trie_body(runner.cache_view, activity.recent, text)
    return out


def state_body(models: ModelRegistry, model: str | None, shown: bool) -> dict[str, Any]:
    """The document (the module docstring); blocking (it decodes text): off the loop."""
    keep_alive = models.keep_alive
    only = None if model is None else models.find(model)
    held = [
        s
        for s in models.status()
        if s.state is not ModelState.UNLOADED and (only is None or s.spec is only)
    ]
    return {
        "object": "admin.state",
        "as_of": round(time.time(), 3),
        "prompts_shown": shown,
        "keep_alive_seconds": keep_alive,
        "memory_budget_bytes": models.memory_budget,
        "models": [model_state(s, keep_alive, shown) for s in held],
    }


def versions(models: ModelRegistry) -> tuple[object, ...]:
    """What changes when the document would: each held model's state and its engine's
    published views (compared, never read through)."""
    out: list[object] = []
    for status in models.status():
        runner = None if status.served is None else status.served.runner
        out.append(status.state)
        if runner is not None:
            out += [runner.activity.view.version, id(runner.cache_view)]
    return tuple(out)


async def state(request: Request) -> JSONResponse:
    models = registry_of(request)
    model = request.query_params.get("model")
    body = await run_in_threadpool(state_body, models, model, shows_prompts(request))
    return JSONResponse(body)


ROUTES = [
    Route("/admin/state", state, methods=["GET"]),
]
