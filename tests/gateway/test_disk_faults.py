"""Disk-tier faults on real file systems (issue 27), on a live server with the tiny Qwen3:

- the cache directory is on a read-only file system at start: the server serves every
  request with the memory cache alone and says so once;
- the directory is on a 1 MB tmpfs that fills up (a real ENOSPC, not a simulated one):
  every request is answered, the tier keeps what fits, least recently used files making
  room for new ones, and the full disk is logged once.

Both mount a tmpfs (`mount -t tmpfs`), which needs root (CAP_SYS_ADMIN): elsewhere they
skip, saying why. (Simulated ENOSPC, truncated and corrupted files and SIGKILL mid-write
are in tests/runtime/prefix and tests/gateway/test_faults.py.)
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings
from runtime.prefix.disk.files import SUFFIX, TMP_SUFFIX
from tests.support.live_server import live_server
from tests.support.openai_checks import chat_body, post

MODEL = "tiny-qwen3"
CHAT = "/v1/chat/completions"
TIER_LOG = "runtime.prefix.disk.tier"
# long enough that a few conversations' KV state outgrows a 1 MB disk
SYSTEM = "You keep the harbour's records: tides, berths, cargo and crews. " * 120
TOPICS = ["tides", "berths", "cargo", "crews", "cranes", "ropes", "keys", "boats", "buoys"]


def _mount(point: Path, options: str) -> None:
    point.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")


@pytest.fixture
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A 1 MB tmpfs, read-only when the test is parametrized so."""
    point = tmp_path / "disk"
    _mount(point, "size=1m" + (",ro" if getattr(request, "param", "") == "ro" else ""))
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)


def _serve(model: Path, cache_dir: Path, **settings: Any) -> Any:
    engine = EngineSettings(prefix_cache_dir=cache_dir, **settings)
    return live_server(lambda: build_served(model, model_id=MODEL, settings=engine))


def _ask(url: str, topic: str) -> tuple[str, int]:
    messages = [  # nothing shared between topics: each conversation is a file of its own
        {"role": "system", "content": f"Records of {topic}. {SYSTEM}"},
        {"role": "user", "content": f"What do the records say about {topic}?"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    reply = chat_body(post(url, CHAT, body))
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert reply.choices[0].finish_reason in ("stop", "length")
    return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens or 0


def _stats(url: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/debug/prefix-cache", timeout=60)
    assert r.status_code == 200, r.text
    stats: dict[str, Any] = r.json()["stats"]
    return stats


def _tier_warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == TIER_LOG and r.levelno >= logging.WARNING and needle in r.getMessage()
    ]


@pytest.mark.parametrize("disk", ["ro"], indirect=True)
def test_a_read_only_cache_directory_leaves_the_memory_cache(
    disk: Path, tiny_qwen3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=TIER_LOG)
    with _serve(tiny_qwen3_dir, disk) as url:
        first = [_ask(url, topic) for topic in TOPICS[:3]]
        again = _ask(url, TOPICS[0])
        stats = _stats(url)
    assert all(cached == 0 for _, cached in first[:1])
    assert again[0] == first[0][0] and again[1] > 0  # the memory cache serves the repeat
    assert "disk_entries" not in stats  # no disk tier
    assert len(_tier_warnings(caplog, "Read-only file system")) == 1
    assert not list(disk.rglob("*"))


def test_a_full_disk_keeps_what_fits(
    disk: Path, tiny_qwen3_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=TIER_LOG)
    # a one-byte memory budget: every prefix paged out of memory goes to disk
    with _serve(tiny_qwen3_dir, disk, prefix_cache_bytes=1) as url:
        replies = {topic: _ask(url, topic)[0] for topic in TOPICS}
        after = _stats(url)
        assert after["disk_write_errors"] >= 1  # the disk did fill up
        assert after["disk_budget_bytes"] < 1 << 20
        # it goes on serving, with what fits: the conversation before the last one was
        # paged out by the last, and comes back from disk
        text, cached = _ask(url, TOPICS[-2])
        stats = _stats(url)
    assert text == replies[TOPICS[-2]] and cached > 100
    assert stats["disk_loads"] > 0 and stats["disk_bad_files"] == 0
    assert len(_tier_warnings(caplog, "is full")) == 1
    assert not _tier_warnings(caplog, "failed")
    files = list((disk / MODEL).glob("*" + SUFFIX))
    assert files and not list(disk.rglob("*" + TMP_SUFFIX))
    assert sum(f.stat().st_size for f in files) <= 1 << 20
