"""POST /v1/responses and the stored responses it chains from."""

from gateway.openai.responses.routes import ROUTES

__all__ = ["ROUTES"]
