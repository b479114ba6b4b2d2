"""The server's own endpoints: models, health, metrics, tokenize, debug."""

from gateway.admin import debug, health, metrics, models, tokenize
from gateway.admin.metrics import MetricsMiddleware

ROUTES = [*models.ROUTES, *tokenize.ROUTES, *health.ROUTES, *metrics.ROUTES, *debug.ROUTES]

__all__ = ["ROUTES", "MetricsMiddleware"]
