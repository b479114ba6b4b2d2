"""The long prompts bench/long_prefill.py times, rendered by the gateway itself.

Agent prompts are the clients' captured first requests (shared/fixtures/clients) sent
through the same dialect adapter, chat template and tokenizer a live server uses.
Synthetic prompts are Python standard-library source (fixed for a given Python, realistic
code) sent as one user message over Chat Completions, cut to the asked token count.

Prompt names: a token count (`512`, `2048`, `4k`, `32k`; k = 1024, capped so the prompt
and the generated tokens fit the context) or a client (`openclaw`, `codex`, `claude`,
optionally written with their size as in `8k-openclaw`).
"""

from __future__ import annotations

import json
import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.core.models import ServedModel

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
# client -> (capture, the route that client sends it to)
CLIENTS = {
    "openclaw": ("openclaw_first_request_chat", CHAT),
    "codex": ("codex_first_request", RESPONSES),
    "claude": ("claude_code_first_request", MESSAGES),
}
DEFAULT = ("512", "4k", "openclaw", "codex", "16k", "claude", "32k")
REFERENCE = "512"  # the gateway's short-prompt speed every other one is compared with
# standard-library modules the synthetic prompts are cut from, in this order (cycled)
_SOURCES = (
    "argparse.py", "dataclasses.py", "typing.py", "pathlib.py", "subprocess.py",
    "functools.py", "enum.py", "json/decoder.py", "json/encoder.py", "textwrap.py",
    "asyncio/tasks.py", "asyncio/base_events.py", "logging/__init__.py", "inspect.py",
)  # fmt: skip
_INTRO = (
    "Below is part of a Python code base. Read all of it, then explain in a few "
    "sentences what each module is for.\n\n"
)


def canonical(name: str) -> str:
    """`8k-openclaw` -> `openclaw`; `4K` -> `4k`; `0512` -> `512`; anything else is an error."""
    name = name.strip().lower()
    client = name.rsplit("-", 1)[-1]
    if client in CLIENTS:
        return client
    m = re.fullmatch(r"(\d+)(k?)", name)
    if m is None or int(m.group(1)) == 0:
        known = ", ".join([*CLIENTS, "a token count like 512, 4k, 32k"])
        raise ValueError(f"unknown prompt {name!r}: use {known}")
    return f"{int(m.group(1))}{m.group(2)}"


def parse_names(spec: str) -> list[str]:
    """Comma-separated names, canonical, in order, without repeats; the reference first."""
    names = [canonical(n) for n in spec.split(",") if n.strip()]
    return list(dict.fromkeys([REFERENCE, *names]))


def target_tokens(name: str, context_length: int, gen_tokens: int) -> int:
    """A synthetic prompt's length: the number asked, capped to leave room to generate."""
    n = int(name.rstrip("k")) * (1024 if name.endswith("k") else 1)
    return min(n, context_length - gen_tokens - 8)


def fixtures_folder(given: str | None) -> Path:
    root = Path(__file__).resolve().parent.parent
    for folder in ([Path(given)] if given else []) + [
        root / "shared/fixtures/clients",
        root.parent / "shared/fixtures/clients",
    ]:
        if (folder / "codex_first_request.json").is_file():
            return folder
    raise SystemExit("no shared/fixtures/clients next to the checkout; pass --fixtures")


def _tokens(served: ServedModel, route: str, body: dict[str, Any]) -> list[int]:
    """The prompt tokens a live server renders for `body` on `route`."""
    from gateway.anthropic import adapt as messages_adapt
    from gateway.anthropic import wire as messages_wire
    from gateway.anthropic.routes import prepare_messages
    from gateway.core.prepare import prepare
    from gateway.openai import adapt as chat_adapt
    from gateway.openai import wire as chat_wire
    from gateway.openai.responses.adapt import response_plan
    from gateway.openai.responses.wire import ResponsesRequest

    body = {**body, "model": served.id}
    tools = served.caps.tools
    if route == MESSAGES:
        req = messages_wire.MessagesRequest.model_validate(body)
        return prepare_messages(served, messages_adapt.chat_plan(req, tools_supported=tools)).tokens
    if route == RESPONSES:
        plan = response_plan(
            ResponsesRequest.model_validate(body),
            history=[],
            lookup=lambda _: None,
            open_sealed=lambda _: None,
            tools_supported=tools,
        ).plan
        return prepare(served, plan).tokens
    chat = chat_wire.ChatCompletionRequest.model_validate(body)
    plan = chat_adapt.chat_plan(chat, vocab_size=served.vocab_size, tools_supported=tools)
    return prepare(served, plan).tokens


def _code_text(min_chars: int) -> str:
    """Standard-library source with a header per file, cycled until long enough."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    while size < min_chars:
        for rel in _SOURCES:
            text = f"# ===== file: {rel} =====\n{(stdlib / rel).read_text(encoding='utf-8')}\n"
            parts.append(text)
            size += len(text)
            if size >= min_chars:
                break
    return "".join(parts)


def _synthetic(served: ServedModel, target: int) -> list[int]:
    """A user message of code whose rendered prompt is `target` tokens (or within a
    token or two, where cutting the text re-tokenizes differently at the cut)."""
    tok = served.loaded.tokenizer

    def render(text: str) -> list[int]:
        return _tokens(served, CHAT, {"messages": [{"role": "user", "content": _INTRO + text}]})

    overhead = len(render(""))
    body = tok.encode(_code_text(6 * target), add_special_tokens=False)
    keep = max(target - overhead, 0)
    ids = render(tok.decode(body[:keep]))
    for _ in range(4):  # the cut may merge or split a token: step towards the target
        if len(ids) == target:
            break
        keep += target - len(ids)
        ids = render(tok.decode(body[: max(keep, 0)]))
    return ids


def render_prompts(
    served: ServedModel, names: Sequence[str], gen_tokens: int, fixtures: Path
) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name in names:
        if name in CLIENTS:
            capture, route = CLIENTS[name]
            body = json.loads((fixtures / f"{capture}.json").read_text(encoding="utf-8"))
            out[name] = _tokens(served, route, body)
        else:
            out[name] = _synthetic(served, target_tokens(name, served.context_length, gen_tokens))
    return out
