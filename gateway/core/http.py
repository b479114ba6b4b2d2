"""Request-body reading and validation shared by the routes."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any, TypeVar

import anyio
from anyio import to_thread
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.core.errors import InvalidRequest, PayloadTooLarge, RequestTimeout
from gateway.core.limits import MAX_JSON_DEPTH
from gateway.core.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY = DEFAULT_MAX_BODY_BYTES
# A body up to this size is parsed and validated on the event loop (well under a
# millisecond); a larger one in a worker thread.
INLINE_BODY_BYTES = 64 * 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


def server_settings(request: Request) -> ServerSettings:
    settings = getattr(request.app.state, "settings", None)
    return settings if isinstance(settings, ServerSettings) else ServerSettings()


def _no_constants(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no field wants them
    raise ValueError(f"{name} is not valid JSON")


def _bad_text(text: str) -> bool:
    """Whether `text` holds an unpaired UTF-16 surrogate (JSON lets "\\ud800" through; the
    tokenizer cannot encode it). Scanned in place: nothing is copied."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def _path(frames: list[_Frame], key: str | int) -> str:
    out = ""
    for part in [*(f.key for f in frames[1:]), key]:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class _Frame:
    """A container being walked: its entries, and the key it sits at in its parent."""

    __slots__ = ("entries", "key")

    def __init__(self, value: dict[str, Any] | list[Any], key: str | int) -> None:
        self.entries: Iterator[tuple[Any, Any]] = iter(
            value.items() if isinstance(value, dict) else enumerate(value)
        )
        self.key = key


def check_json(data: Any) -> None:
    """A 400 for a parsed body nested deeper than MAX_JSON_DEPTH, or holding an unpaired
    surrogate (in a key or a string; the message names where). One pass, each value
    visited once; memory grows with the depth only, and a path is written only for the
    value it names."""
    if isinstance(data, str):
        if _bad_text(data):
            raise _surrogate("body")
        return
    if not isinstance(data, (dict, list)):
        return
    frames = [_Frame(data, "")]
    while frames:
        top = frames[-1]
        for key, value in top.entries:
            if isinstance(key, str) and _bad_text(key):
                # the key itself cannot be shown: the error's JSON must encode
                raise _surrogate(f"a key in {_path(frames[:-1], top.key) or 'body'}")
            if isinstance(value, str):
                if _bad_text(value):
                    raise _surrogate(_path(frames, key))
            elif isinstance(value, (dict, list)):
                if len(frames) >= MAX_JSON_DEPTH:
                    raise _too_deep()
                frames.append(_Frame(value, key))
                break
        else:
            frames.pop()


def _surrogate(where: str) -> InvalidRequest:
    return InvalidRequest(
        f"{where} holds an unpaired UTF-16 surrogate; send valid Unicode text.",
        param=where.removeprefix("a key in "),
    )


def _too_deep() -> InvalidRequest:
    return InvalidRequest(
        f"The request body is nested more than {MAX_JSON_DEPTH} levels deep (objects and "
        "arrays); this server accepts at most that: send a flatter body.",
        code="too_deeply_nested",
    )


def _parse(body: bytes | bytearray) -> Any:
    try:
        data = json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    check_json(data)
    return data


async def _read_body(request: Request, max_bytes: int | None) -> bytearray:
    settings = server_settings(request)
    limit = max_bytes if max_bytes is not None else settings.max_body_bytes
    declared = request.headers.get("content-length")
    too_big = f"The request body exceeds this server's limit of {limit} bytes."
    # the rest of the body is never read: the connection closes (lingering, so the
    # client still reads this answer: gateway/server/linger.py)
    close = {"Connection": "close"}
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(too_big, code="request_too_large", headers=close)
    body = bytearray()
    try:
        with anyio.fail_after(settings.body_timeout_seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise PayloadTooLarge(too_big, code="request_too_large", headers=close)
    except TimeoutError:
        seconds = f"{settings.body_timeout_seconds:g}"
        raise RequestTimeout(
            f"The request body did not arrive within {seconds} s ({len(body)} bytes came); "
            "send the whole body at once.",
            code="request_timeout",
            headers=close,
        ) from None
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    return body


async def read_json(request: Request, *, max_bytes: int | None = None) -> Any:
    """The body as checked JSON (check_json); parsed off the event loop when large."""
    body = await _read_body(request, max_bytes)
    if len(body) <= INLINE_BODY_BYTES:
        return _parse(body)
    # parsing and checking take milliseconds per megabyte: not on the event loop
    return await to_thread.run_sync(_parse, body)


def _parse_into(model: type[M], body: bytearray) -> M:
    return validate(model, _parse(body))


async def read_model(request: Request, model: type[M]) -> M:
    """The body read, parsed, checked and validated into `model`; the work done off the
    event loop when the body is large (pydantic too takes milliseconds per megabyte)."""
    body = await _read_body(request, None)
    if len(body) <= INLINE_BODY_BYTES:
        return _parse_into(model, body)
    return await to_thread.run_sync(_parse_into, model, body)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part):
            continue  # pydantic names the union branch it tried ("str", "list[ContentPart]")
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = _loc(tuple(first["loc"]))
        lines = dict.fromkeys(f"{_loc(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        detail = "; ".join(list(lines)[:5])
        raise InvalidRequest(f"Invalid request: {detail}", param=where or None) from None
    if parsed.model_extra:
        # names a client chose: quoted (no forged log lines) and cut short (no floods)
        names = sorted(parsed.model_extra)
        shown = ", ".join(repr(n[:40]) for n in names[:8]) + (", ..." if len(names) > 8 else "")
        log.info("ignoring unknown fields: %s", shown)
    return parsed
