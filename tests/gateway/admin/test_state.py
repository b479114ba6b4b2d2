"""GET /admin/state and GET /admin/events (gateway/admin/state.py, events.py) against a JSON
schema, on the tiny random Qwen3: the batch, the recent requests with their cache
reports, the trie's shared prefixes, the stream's events, and the prompt-text rule."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from starlette.applications import Starlette
from starlette.requests import Request

from gateway.admin.state import shows_prompts
from gateway.core.models.build import build_served
from gateway.core.settings import ServerSettings
from tests.support.live_server import live_server
from tests.support.long_chat import LongChat

MODEL = "tiny-qwen3"
CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly. " * 4}
KEY = "sekrit-admin-key"

NUM = {"type": "number"}
INT = {"type": "integer", "minimum": 0}
OPT_NUM = {"type": ["number", "null"]}
OPT_INT = {"type": ["integer", "null"]}


def _obj(props: dict[str, Any], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    required = [k for k in props if k not in optional]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


CACHE = _obj({"reason": {"type": "string"}, "detail": {"type": "string"},
              "matched": INT, "reused": INT})  # fmt: skip
ROW = _obj({
    "id": INT, "phase": {"enum": ["queued", "prefill", "decode"]}, "prompt_tokens": INT,
    "cached_tokens": OPT_INT, "prefilled_tokens": INT,
    "progress": {"type": "number", "minimum": 0, "maximum": 1}, "generated_tokens": INT,
    "max_tokens": INT, "age_seconds": NUM, "ttft_seconds": OPT_NUM,
    "tokens_per_second": OPT_NUM, "cache_request": OPT_INT, "drafted_tokens": INT,
    "accepted_tokens": INT,
})  # fmt: skip
RECORD = _obj({
    "id": INT, "cache_request": OPT_INT, "prompt_tokens": INT, "cached_tokens": INT,
    "completion_tokens": INT, "finish_reason": {"enum": ["stop", "length", "cancelled", "error"]},
    "error": {"type": ["string", "null"]}, "ttft_seconds": OPT_NUM, "tokens_per_second": NUM,
    "prefill_tokens_per_second": NUM, "ended_at": NUM, "drafted_tokens": INT,
    "accepted_tokens": INT, "cache": {"anyOf": [{"type": "null"}, CACHE]}, "prompt": {"type": ["string", "null"]},
}, optional=("prompt",))  # fmt: skip
NODE = _obj({
    "id": INT, "parent": OPT_INT, "start": INT, "end": INT, "tokens": INT,
    "memory_bytes": INT, "layers": INT, "disk_layers": INT, "live": {"type": "boolean"},
    "pinned": {"type": "boolean"}, "evicted": {"type": "boolean"},
    "next_eviction": {"type": "boolean"}, "last_used": INT,
    "requests": {"type": "array", "items": INT}, "reused_by": {"type": "array", "items": INT},
    "text": {"type": "string"},
}, optional=("text",))  # fmt: skip
TRIE = _obj({
    "as_of": NUM, "stats": {"type": "object", "additionalProperties": INT},
    "pins": {"type": "array", "items": {"type": "object"}}, "nodes_total": INT,
    "nodes": {"type": "array", "items": NODE, "minItems": 1},
})  # fmt: skip
MEMORY = _obj({k: INT for k in (
    "counted_bytes", "weights_bytes", "cache_budget_bytes", "running_kv_bytes",
    "running_kv_projected_bytes", "trie_memory_bytes", "trie_limit_bytes",
    "trie_budget_bytes", "disk_bytes", "disk_budget_bytes",
)})  # fmt: skip
MODEL_STATE = _obj({
    "id": {"type": "string"}, "state": {"enum": ["loaded", "loading", "unloading"]},
    "idle_seconds": OPT_NUM, "keep_alive_left_seconds": OPT_NUM, "max_batch": OPT_INT,
    "memory": {"anyOf": [{"type": "null"}, MEMORY]},
    "queue": {"anyOf": [{"type": "null"}, _obj({"waiting": INT, "capacity": INT})]},
    "batch": {"type": "array", "items": ROW}, "recent": {"type": "array", "items": RECORD},
    "trie": {"anyOf": [{"type": "null"}, TRIE]},
})  # fmt: skip
STATE = _obj({
    "object": {"const": "admin.state"}, "as_of": NUM, "prompts_shown": {"type": "boolean"},
    "keep_alive_seconds": NUM, "memory_budget_bytes": INT,
    "models": {"type": "array", "items": MODEL_STATE},
})  # fmt: skip


def valid(body: dict[str, Any]) -> dict[str, Any]:
    jsonschema.validate(body, STATE)
    return body


@pytest.fixture(scope="module")
def url(tiny_qwen3_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL)) as base:
        yield base


def _chat(base: str, user: str, **extra: Any) -> dict[str, Any]:
    messages = [SYSTEM, {"role": "user", "content": user}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(base + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _state(base: str, **params: str) -> dict[str, Any]:
    r = httpx.get(base + "/admin/state", params=params, timeout=30)
    assert r.status_code == 200, r.text
    return valid(r.json())


def test_state_shows_the_shared_prefix_and_the_cache_reports(url: str) -> None:
    first = _chat(url, "Name a colour.")
    second = _chat(url, "Name a fruit.")
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    body = _state(url)
    assert body["prompts_shown"] is True  # a loopback bind, a client on this machine
    (model,) = body["models"]
    assert model["id"] == MODEL and model["state"] == "loaded" and model["batch"] == []
    a, b = model["recent"][-2:]
    assert a["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert b["cached_tokens"] == cached and b["cache"]["reused"] == cached
    assert b["cache"]["reason"] == "diverged" and "fruit" in b["prompt"]
    nodes = model["trie"]["nodes"]
    shared = [n for n in nodes if a["id"] in n["requests"] and b["id"] in n["requests"]]
    assert shared, "no node that both requests passed through"
    assert sum(n["tokens"] for n in shared) == cached  # the system prompt and what follows
    assert all(b["id"] in n["reused_by"] for n in shared)
    assert any("careful assistant" in n["text"] for n in shared)
    own = [n for n in nodes if n["requests"] == [b["id"]]]  # b's own branch
    assert own and all(n["parent"] is not None for n in own)
    assert model["memory"]["trie_memory_bytes"] == model["trie"]["stats"]["paged_bytes"]
    assert model["memory"]["weights_bytes"] > 0
    # the older view keeps answering
    assert httpx.get(url + "/debug/prefix-cache").json()["stats"]["requests"] >= 2


def test_one_model_or_an_unknown_name(url: str) -> None:
    assert [m["id"] for m in _state(url, model=MODEL)["models"]] == [MODEL]
    r = httpx.get(url + "/admin/state", params={"model": "nope"})
    assert r.status_code == 404
    assert httpx.get(url + "/admin/events", params={"model": "nope"}).status_code == 404


class Events(threading.Thread):
    """Reads /admin/events, each state into `seen`, until `wanted(state)` holds."""

    def __init__(self, base: str, wanted: Any) -> None:
        super().__init__(daemon=True)
        self.base, self.wanted = base, wanted
        self.seen: list[dict[str, Any]] = []
        self.opened = threading.Event()

    def run(self) -> None:
        with httpx.stream("GET", self.base + "/admin/events", timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            event = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "state":
                    self.seen.append(valid(json.loads(line[5:])))
                    self.opened.set()
                    if self.wanted(self.seen[-1]):
                        return


def _rows(state: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    return [r for r in state["models"][0]["batch"] if r["phase"] == phase]


def test_the_event_stream_shows_a_request_running_then_ended(url: str) -> None:
    running = Events(url, lambda state: _rows(state, "decode"))
    running.start()
    assert running.opened.wait(60)
    chat = LongChat(url, MODEL, [SYSTEM, {"role": "user", "content": "Count."}], 60000)
    chat.start()
    running.join(60)  # until an event shows the request decoding
    assert not running.is_alive() and chat.status == 200
    (row,) = _rows(running.seen[-1], "decode")
    assert row["prompt_tokens"] == row["prefilled_tokens"] and row["progress"] == 1
    ended = Events(
        url, lambda state: any(r["id"] == row["id"] for r in state["models"][0]["recent"])
    )
    ended.start()
    assert ended.opened.wait(60)
    chat.end()  # the connection closes: the request is cancelled
    ended.join(60)
    assert not ended.is_alive()
    (record,) = [r for r in ended.seen[-1]["models"][0]["recent"] if r["id"] == row["id"]]
    assert record["finish_reason"] == "cancelled" and record["completion_tokens"] > 0


def _request(host: str, client: str, key: str | None) -> Request:
    app = Starlette()
    app.state.settings = ServerSettings(host=host, api_key=key)
    scope = {"type": "http", "app": app, "client": (client, 5000), "headers": []}
    return Request(scope)


def test_prompt_text_follows_the_debug_rule() -> None:
    assert shows_prompts(_request("127.0.0.1", "127.0.0.1", None))
    assert not shows_prompts(_request("0.0.0.0", "127.0.0.1", None))
    assert not shows_prompts(_request("127.0.0.1", "10.0.0.7", None))
    assert shows_prompts(_request("0.0.0.0", "10.0.0.7", KEY))  # the key let it in


def test_hidden_prompts_leave_no_text(tiny_qwen3_dir: Path) -> None:
    settings = ServerSettings(host="0.0.0.0", api_key=None)
    served = build_served(tiny_qwen3_dir, model_id=MODEL)
    with live_server(lambda: served, settings) as base:
        _chat(base, "Name a river.")
        _chat(base, "Name a lake.")
        body = _state(base)
    (model,) = body["models"]
    assert body["prompts_shown"] is False
    assert all("prompt" not in r for r in model["recent"])
    assert all("text" not in n for n in model["trie"]["nodes"])
    assert len(model["trie"]["nodes"]) > 1


def test_with_a_key_the_state_needs_it(tiny_qwen3_dir: Path) -> None:
    served = build_served(tiny_qwen3_dir, model_id=MODEL)
    with live_server(lambda: served, ServerSettings(api_key=KEY)) as base:
        assert httpx.get(base + "/admin/state").status_code == 401
        assert httpx.get(base + "/admin/events").status_code == 401
        headers = {"Authorization": f"Bearer {KEY}"}
        body = valid(httpx.get(base + "/admin/state", headers=headers).json())
    assert body["prompts_shown"] is True
