"""Anthropic's dialect: Messages and count_tokens."""

from gateway.anthropic.routes import ROUTES

__all__ = ["ROUTES"]
