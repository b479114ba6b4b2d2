"""OpenAI's dialect: Chat Completions, Completions and Responses."""

from gateway.openai.chat.routes import ROUTES as _CHAT
from gateway.openai.completions import ROUTES as _COMPLETIONS
from gateway.openai.responses.routes import ROUTES as _RESPONSES

ROUTES = [*_CHAT, *_COMPLETIONS, *_RESPONSES]

__all__ = ["ROUTES"]
