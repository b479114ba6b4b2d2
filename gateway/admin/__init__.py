"""The server's own endpoints: models, health, metrics, tokenize, debug, ps, and the
engine's state (state, its trie part, and its event stream)."""

from gateway.admin import debug, events, health, metrics, models, ps, state, tokenize
from gateway.admin.metrics import MetricsMiddleware

ROUTES = [
    *models.ROUTES,
    *tokenize.ROUTES,
    *health.ROUTES,
    *metrics.ROUTES,
    *debug.ROUTES,
    *ps.ROUTES,
    *state.ROUTES,
    *events.ROUTES,
]

__all__ = ["ROUTES", "MetricsMiddleware"]
