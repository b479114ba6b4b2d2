"""POST /v1/chat/completions."""

from gateway.openai.chat.routes import ROUTES

__all__ = ["ROUTES"]
