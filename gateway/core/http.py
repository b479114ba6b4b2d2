"""Request-body reading and validation shared by the routes."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.core.errors import InvalidRequest, PayloadTooLarge, RequestTimeout
from gateway.core.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY = DEFAULT_MAX_BODY_BYTES


def server_settings(request: Request) -> ServerSettings:
    settings = getattr(request.app.state, "settings", None)
    return settings if isinstance(settings, ServerSettings) else ServerSettings()


def _no_constants(name: str) -> Any:
    # Python's json accepts NaN and Infinity; JSON does not, and no field wants them
    raise ValueError(f"{name} is not valid JSON")


def _find_surrogate(data: Any) -> str | None:
    """The path of the first string holding an unpaired UTF-16 surrogate (JSON lets
    "\\ud800" through; the tokenizer cannot encode it)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


async def read_json(request: Request, *, max_bytes: int | None = None) -> Any:
    settings = server_settings(request)
    limit = max_bytes if max_bytes is not None else settings.max_body_bytes
    declared = request.headers.get("content-length")
    too_big = f"The request body exceeds this server's limit of {limit} bytes."
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(too_big, code="request_too_large")
    body = bytearray()
    try:
        with anyio.fail_after(settings.body_timeout_seconds):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise PayloadTooLarge(too_big, code="request_too_large")
    except TimeoutError:
        seconds = f"{settings.body_timeout_seconds:g}"
        raise RequestTimeout(
            f"The request body did not arrive within {seconds} s ({len(body)} bytes came); "
            "send the whole body at once.",
            code="request_timeout",
            headers={"Connection": "close"},  # the rest of the body is never read
        ) from None
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        data = json.loads(body, parse_constant=_no_constants)
    except RecursionError:
        raise InvalidRequest("The request body is nested too deeply.") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    where = _find_surrogate(data)
    if where is not None:
        raise InvalidRequest(
            f"{where} holds an unpaired UTF-16 surrogate; send valid Unicode text.", param=where
        )
    return data


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
