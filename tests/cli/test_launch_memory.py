"""`mlx-gateway launch openclaw` and the embedding model: OpenClaw's memory search pointed
at the gateway's /v1/embeddings (the served embedding model, or --embedding-model's),
left alone when none is served, the user's memory settings put back by --restore; and
/v1/models read across every card (the chat model need not be listed first)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gateway.cli.launch import server
from gateway.cli.launch.server import Endpoint
from tests.cli.test_launch import USER_OPENCLAW, Scratch, launch
from tests.cli.test_launch import scratch as scratch_fixture  # noqa: F401 - used by name
from tests.support.live_server import free_port

CHAT, EMBED, RERANK = "qwen-test", "minilm", "a-reranker"


@pytest.fixture
def scratch(request: pytest.FixtureRequest) -> Scratch:
    """test_launch's scratch HOME, gateway home and client folder."""
    value: Scratch = request.getfixturevalue("scratch_fixture")
    return value


def _card(name: str, task: str | None, **more: Any) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "context_length": 32768, **more}
    if task is not None:
        card["task"] = task
    return card


@contextmanager
def gateway(cards: list[dict[str, Any]]) -> Iterator[int]:
    """/health and a /v1/models listing `cards`; yields the port."""

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": cards})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models)])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive()
        time.sleep(0.02)
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(10)


SERVED = [
    _card(EMBED, None, capabilities={"task": "embed"}, aliases=["emb"]),  # loaded: caps say
    _card("emb", "embed", alias_of=EMBED),
    _card(RERANK, "rerank"),
    _card(CHAT, "generate"),
]
# settings of the user's own embedding provider, and one of memory search itself
USER_MEMORY = {
    "search": {
        "provider": "openai",
        "model": "text-embedding-3-small",
        "remote": {"baseUrl": "https://example.invalid/v1", "apiKey": "sk-x"},
        "fallback": "none",
        "sources": ["memory"],
    }
}


def _user_file(s: Scratch, memory: bool) -> Path:
    path = s.home / ".openclaw" / "openclaw.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({**USER_OPENCLAW, **({"memory": USER_MEMORY} if memory else {})}))
    return path


def test_the_chat_model_and_the_embedders_are_read_from_every_card() -> None:
    served = server.parse_models(json.dumps({"data": SERVED}).encode())
    assert (served.model, served.embedders) == (CHAT, (EMBED,))  # an alias is not another
    assert served.tasks == {EMBED: "embed", "emb": "embed", RERANK: "rerank", CHAT: "generate"}
    old = server.parse_models(json.dumps({"data": [{"id": "m"}, {"id": "e"}]}).encode())
    assert (old.model, old.embedders) == ("m", ())  # a server that says no task: none picked
    command = server.serve_command("m", Endpoint("127.0.0.1", 1, None), [EMBED])
    assert command[command.index("serve") :][:5] == ["serve", "--model", "m", "--model", EMBED]


@pytest.mark.parametrize("memory", [False, True])
def test_memory_search_embeds_on_the_gateway_and_restore_puts_the_users_back(
    scratch: Scratch, memory: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _user_file(scratch, memory)
    with gateway(SERVED) as port:
        assert launch("openclaw", "--port", str(port), "--config", "--yes") == 0
        config = json.loads(path.read_text())
        first = path.read_bytes()
        # a second launch (memory search is ours now) must not forget the user's provider
        assert launch("openclaw", "--port", str(port), "--config", "--yes") == 0
        assert path.read_bytes() == first
    search = config["memory"]["search"]
    assert search == {
        "provider": "mlx-gateway",
        "model": EMBED,
        **({"sources": ["memory"]} if memory else {}),
    }
    provider = config["models"]["providers"]["mlx-gateway"]
    assert provider["baseUrl"] == f"http://127.0.0.1:{port}/v1"
    assert [row["id"] for row in provider["models"]] == [CHAT]  # not a chat model to pick
    assert f"memory search embeds with {EMBED}" in capsys.readouterr().err
    assert launch("openclaw", "--restore") == 0
    restored = json.loads(path.read_text())
    assert restored == {**USER_OPENCLAW, **({"memory": USER_MEMORY} if memory else {})}


def test_without_an_embedding_model_memory_search_is_left_alone(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _user_file(scratch, memory=True)
    with gateway([_card(CHAT, "generate"), _card(RERANK, "rerank")]) as port:
        assert launch("openclaw", "--port", str(port), "--config", "--yes") == 0
    assert json.loads(path.read_text())["memory"] == USER_MEMORY
    err = capsys.readouterr().err
    assert "memory search is left as it was: the gateway serves no embedding model" in err


def test_the_embedding_model_option_picks_one_and_is_checked(
    scratch: Scratch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _user_file(scratch, memory=False)
    second = _card("bge", "embed")
    with gateway([*SERVED, second]) as port:
        base = ("openclaw", "--port", str(port), "--config", "--yes")
        assert launch(*base, "--embedding-model", "bge") == 0
        assert json.loads(path.read_text())["memory"]["search"]["model"] == "bge"
        before = path.read_bytes()
        assert launch(*base, "--embedding-model", "nomic") == 1
        assert "does not serve 'nomic'" in capsys.readouterr().err
        assert launch(*base, "--embedding-model", RERANK) == 1
        assert f"{RERANK!r} is not an embedding model" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert launch("openclaw", "--restore", "--embedding-model", "bge") == 1
