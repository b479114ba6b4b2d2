"""The real clients' captured requests (shared/fixtures/clients) replayed against a live
SmolLM2 server: each gets a 200 or a clear 4xx naming what to change, never a 500.

SmolLM2's template has no tool format, so the OpenAI-dialect captures are refused on
`tools`; replayed without tools (and with every text cut short, so the prefill stays
quick on a CPU) their message shapes are served. Codex and Claude Code speak other APIs
(Responses, Anthropic Messages): they must get a clear 4xx, not a 500.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.core.serving import build_served
from tests.live_server import live_server
from tests.openai_checks import chat_chunks, chat_texts, error_of, post, stream

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
OPENAI_CHAT = [
    "openclaw_first_request_chat",
    "openclaw_tool_result_request_chat",
    "opencode_first_request_chat",
]
OTHER_DIALECTS = {
    "codex_first_request": "/v1/responses",
    "codex_tool_result_request": "/v1/responses",
    "openclaw_first_request_responses": "/v1/responses",
    "claude_code_first_request": "/v1/messages",
    "claude_code_tool_result_request": "/v1/messages",
    "openclaw_first_request_anthropic": "/v1/messages",
}
ENV = "MLX_GATEWAY_CLIENT_FIXTURES"


@pytest.fixture(scope="module")
def fixtures_dir() -> Path:
    """shared/fixtures/clients in the checkout or next to it, or the folder named by $ENV."""
    root = Path(__file__).resolve().parent.parent
    candidates = [Path(os.environ[ENV])] if os.environ.get(ENV) else []
    candidates += [root / "shared/fixtures/clients", root.parent / "shared/fixtures/clients"]
    for folder in candidates:
        if (folder / "opencode_first_request_chat.json").is_file():
            return folder
    pytest.skip(f"no captured client requests (set {ENV} to shared/fixtures/clients)")


@pytest.fixture(scope="module")
def base_url(smollm2_gguf: Path) -> Iterator[str]:
    with live_server(lambda: build_served(smollm2_gguf, model_id=MODEL)) as url:
        yield url


def _load(folder: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    return data


def _cut(value: Any, keep: int = 160) -> Any:
    """Every string shortened, the structure kept."""
    if isinstance(value, str):
        return value[:keep]
    if isinstance(value, list):
        return [_cut(v, keep) for v in value]
    if isinstance(value, dict):
        return {
            k: (
                v
                if k in ("role", "type", "id", "tool_call_id", "name", "arguments")
                else _cut(v, keep)
            )
            for k, v in value.items()
        }
    return value


@pytest.mark.parametrize("name", OPENAI_CHAT)
def test_openai_dialect_captures(base_url: str, fixtures_dir: Path, name: str) -> None:
    captured = _load(fixtures_dir, name)
    assert captured["stream"] is True
    err = error_of(post(base_url, CHAT, captured), 404)  # as captured: a model we do not serve
    assert err["param"] == "model" and "fake-model" in err["message"]
    ours = {**captured, "model": MODEL}
    err = error_of(post(base_url, CHAT, ours), 400)  # SmolLM2 cannot call tools
    assert err["param"] == "tools" and "tool" in err["message"]
    shapes = {k: v for k, v in ours.items() if k not in ("tools", "tool_choice")}
    shapes["messages"] = _cut(ours["messages"])
    for key in ("max_tokens", "max_completion_tokens"):
        if key in shapes:
            shapes[key] = 4
    chunks = chat_chunks(stream(base_url, CHAT, shapes))
    assert list(chat_texts(chunks)) == [0]
    assert chunks[-1].usage is not None  # stream_options.include_usage was asked for


@pytest.mark.parametrize("name", sorted(OTHER_DIALECTS))
def test_other_dialects_get_a_clear_4xx(base_url: str, fixtures_dir: Path, name: str) -> None:
    path = fixtures_dir / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"{name} not captured")
    body = json.loads(path.read_text())
    r = post(base_url, OTHER_DIALECTS[name], body)
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error_of(r, r.status_code)
    wrong = post(base_url, CHAT, body)  # sent to the chat route by mistake
    error_of(wrong, wrong.status_code)
    assert 400 <= wrong.status_code < 500
