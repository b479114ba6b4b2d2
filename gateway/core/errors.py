"""One error hierarchy, mapped to each dialect's error JSON by the app's handlers."""

from __future__ import annotations

import logging
import secrets
from typing import Any

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """Routes that answer errors in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def anthropic_type(self) -> str:
        """Anthropic's error type for this status."""
        return _ANTHROPIC_TYPES.get(
            self.status, "api_error" if self.status >= 500 else "invalid_request_error"
        )

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The error JSON in the dialect of the route at `path`."""
        return self.anthropic_body() if is_anthropic_path(path) else self.openai_body()

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status = 401
    type = "authentication_error"


class Forbidden(APIError):
    """Not for this client: a Host this server does not answer to, or a local-only page
    asked from another machine."""

    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class RequestTimeout(APIError):
    """The client did not send its request body in time (a stalled or trickling upload)."""

    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(APIError):
    """A body type a browser may send cross-site without asking (a form, text/plain)."""

    status = 415
    type = "invalid_request_error"


class Unprocessable(APIError):
    """Well-formed, but this model cannot process it (its chat template refused)."""

    status = 422
    type = "invalid_request_error"


class RateLimited(APIError):
    """The request queue is full; the client should retry after Retry-After."""

    status = 429
    type = "rate_limit_error"


class Overloaded(APIError):
    """The server cannot take requests now (starting or stopping)."""

    status = 503
    type = "overloaded_error"


class EngineFailed(Overloaded):
    """The engine's worker failed or stalled and is restarting (the model stays loaded):
    not the request's fault, so a retry after Retry-After is expected to work."""

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message, code="engine_failed", headers={"Retry-After": str(retry_after)})


class InternalError(APIError):
    status = 500
    type = "server_error"


def internal_error(
    log: logging.Logger, what: str, *, code: str | None = None, exc: BaseException | None = None
) -> InternalError:
    """A 500 that names a request id instead of the failure: what failed (and the
    traceback of `exc`) goes to the server's log with the same id."""
    request_id = "req_" + secrets.token_hex(8)
    log.error("%s [request id %s]", what, request_id, exc_info=exc)
    return InternalError(
        f"internal error (request id {request_id}); the server's log has the details",
        code=code,
        headers={"x-request-id": request_id},
    )
