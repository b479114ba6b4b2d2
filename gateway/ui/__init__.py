"""The browser page: GET / from a browser (Accept: text/html) and its static files under
/ui/ (gateway/ui/static/: plain ES modules and a stylesheet, shipped as package data).
The page reads /v1/models, /v1/chat/completions and /admin/events as any client does."""

from gateway.ui.routes import ROUTES

__all__ = ["ROUTES"]
