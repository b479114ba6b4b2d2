"""Request-body reading and validation shared by the routes."""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import InvalidRequest, PayloadTooLarge

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_BODY = 32 * 1024 * 1024


async def read_json(request: Request, *, max_bytes: int = DEFAULT_MAX_BODY) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
    if not body:
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = _loc(tuple(first["loc"]))
        detail = "; ".join(f"{_loc(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors[:5])
        raise InvalidRequest(f"Invalid request: {detail}", param=where or None) from None
    if parsed.model_extra:
        log.info("ignoring unknown fields: %s", ", ".join(sorted(parsed.model_extra)))
    return parsed
