"""OpenAI's dialect: Chat Completions, Completions, Embeddings and Responses."""

from gateway.openai.chat.routes import ROUTES as _CHAT
from gateway.openai.completions import ROUTES as _COMPLETIONS
from gateway.openai.embeddings import ROUTES as _EMBEDDINGS
from gateway.openai.responses.routes import ROUTES as _RESPONSES

ROUTES = [*_CHAT, *_COMPLETIONS, *_EMBEDDINGS, *_RESPONSES]

__all__ = ["ROUTES"]
