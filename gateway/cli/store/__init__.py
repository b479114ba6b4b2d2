"""The model store: aliases, paths and Hub repo ids -> local model files, and the `pull`
and `list` commands."""

from gateway.cli.store.commands import list_models, pull
from gateway.cli.store.store import Store, StoreError, gateway_home

__all__ = ["Store", "StoreError", "gateway_home", "list_models", "pull"]
