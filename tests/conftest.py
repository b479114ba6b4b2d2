"""Test-wide setup: the optimized BLAS must be loaded before anything imports mlx."""

from __future__ import annotations

from runtime import backend

backend.configure()

from tests.support.agent_model import tiny_qwen3_dir  # noqa: E402, F401  (agent-scale tiny model)
from tests.support.fixtures_real import *  # noqa: E402, F403  (model and tokenizer fixtures)
