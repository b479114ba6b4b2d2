"""What every dialect shares: the neutral plan, prepare, running generations, usage,
structured output, images, auth, settings and the error hierarchy (models/: the served
models' lifecycle).

Only the error hierarchy and the settings are exported here, from modules that import
nothing of ours: every `import gateway.core.<module>` runs this file first."""

from gateway.core.errors import (
    APIError,
    EngineFailed,
    Forbidden,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    RequestTimeout,
    Unauthorized,
    Unprocessable,
    UnsupportedMediaType,
)
from gateway.core.settings import ServerSettings

__all__ = [
    "APIError",
    "EngineFailed",
    "Forbidden",
    "InternalError",
    "InvalidRequest",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "ServerSettings",
    "Unauthorized",
    "Unprocessable",
    "UnsupportedMediaType",
]
