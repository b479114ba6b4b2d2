"""Test-wide setup: the optimized BLAS must be loaded before anything imports mlx.

The references that run on PyTorch (transformers, sentence-transformers) do so on one
intra-op thread. With the BLAS above loaded globally first, torch's two OpenMP threads
and that BLAS's own threads contend for the 2 cores the suite's 2 workers already fill:
sentence-transformers encoded the all-MiniLM test's 270 sentences in 82 s on two threads
and in 7.6 s on one (the same on one thread with no preload), and Qwen2.5-0.5B's 32
greedy steps took 17 s and 6 s."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from runtime import backend

backend.configure()

from tests.support.agent_model import tiny_qwen3_dir  # noqa: E402, F401  (agent-scale tiny model)
from tests.support.fixtures_real import *  # noqa: E402, F403  (model and tokenizer fixtures)


def _torch_on_one_thread() -> None:
    torch = sys.modules.get("torch")  # imported by whichever test needs it, if any
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test's fixtures (module-scoped references included) and its body."""
    _torch_on_one_thread()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Again after the fixtures, for a test whose fixtures imported torch first."""
    _torch_on_one_thread()


# The files that take one worker longest (seconds on the 2-core machine with the suite
# running beside them), longest first. pytest-xdist's --dist loadfile hands a worker a
# whole file, by default those with the most tests first (--loadscope-reorder), which
# left these few-test files for the end, where the last of them ran alone.
SLOW_FIRST = (
    "tests/runtime/distributed/test_distributed_engine.py",  # about 150 s
    "tests/gateway/test_soak_short.py",  # a fixed minute, and its server's start
    "tests/gateway/test_multi_model.py",
    "tests/runtime/load/test_real_models.py",
    "tests/gateway/test_distributed_serve.py",
    "tests/runtime/distributed/test_distributed_shard.py",
    "tests/gateway/anthropic/test_anthropic.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """xdist hands out files in the order collected (below) rather than reordering them."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOW_FIRST's files first, then the rest as xdist would order them (most tests
    first); each file's tests keep their order."""
    counts = Counter(_file(item) for item in items)
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def key(item: pytest.Item) -> tuple[int, int]:
        name = _file(item)
        return rank.get(name, len(rank)), -counts[name]

    items.sort(key=key)  # stable


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]
