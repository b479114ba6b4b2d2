"""One error hierarchy, mapped to each dialect's error JSON by the app's handlers."""

from __future__ import annotations

from typing import Any


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


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(APIError):
    status = 413
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


class InternalError(APIError):
    status = 500
    type = "server_error"
