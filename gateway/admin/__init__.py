"""The server's own endpoints: models, health, metrics, tokenize, debug, ps."""

from gateway.admin import debug, health, metrics, models, ps, tokenize
from gateway.admin.metrics import MetricsMiddleware

ROUTES = [
    *models.ROUTES,
    *tokenize.ROUTES,
    *health.ROUTES,
    *metrics.ROUTES,
    *debug.ROUTES,
    *ps.ROUTES,
]

__all__ = ["ROUTES", "MetricsMiddleware"]
