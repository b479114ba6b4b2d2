"""An agent conversation with a hybrid model, over the wire (issue 10): every follow-up
turn reports `cached_tokens` covering all the earlier turns, although the model's gated
delta-net layers cannot rewind (their state is restored from snapshots, never cut back).

The model is a tiny random Qwen3.5 (3 gated delta-net layers, 1 gated attention layer)
with the real Qwen3 tokenizer and chat template, served by the gateway and driven through
the OpenAI and Anthropic SDKs the way agents resend a conversation: the whole history,
the server's own earlier replies included, plus one new user message.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from gateway.core.models.build import build_served  # noqa: E402
from tests.support import tiny_hybrid  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.tiny_models import save_tiny  # noqa: E402

MODEL_ID = "tiny-qwen3.5-hybrid"
SYSTEM = " ".join(f"Rule {i}: keep the change small and explain it." for i in range(40))
QUESTIONS = ("List the files.", "Open the first one.", "Now fix the bug.", "Run the tests.")


@pytest.fixture(scope="module")
def hybrid_dir(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-qwen3_5-text")
    tok = json.loads((qwen3_tokenizer_dir / "tokenizer.json").read_text())
    ids = [*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])]
    vocab = max(ids) + 1

    def build() -> Any:
        return tiny_hybrid._qwen3_5_text(
            vocab_size=vocab, max_position_embeddings=8192, eos_token_id=151645
        )

    save_tiny((build, None), out, 0, tiny_hybrid._randomize)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / name, out / name)
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"].count("linear_attention") == 3  # a hybrid, not all attention
    return out


@pytest.fixture(scope="module")
def url(hybrid_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(hybrid_dir, model_id=MODEL_ID)) as base:
        yield base


def _opener_tokens(url: str) -> int:
    """Tokens of the generation prompt (`<|im_start|>assistant\\n`): they end every
    request's prompt but not the next turn's history, which re-renders the reply there."""
    import httpx

    def count(messages: list[dict[str, str]], **extra: Any) -> int:
        body = {"model": MODEL_ID, "messages": messages, **extra}
        reply = httpx.post(f"{url}/tokenize", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["count"])

    user = [{"role": "user", "content": "hi"}]
    return count(user) - count(user, add_generation_prompt=False)


def test_openai_turns_reuse_every_earlier_turn(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    opener = _opener_tokens(url)
    assert 0 < opener <= 4
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    earlier = 0  # the previous request's prompt: every earlier turn, rendered
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            max_tokens=6,
            temperature=0,
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        if turn == 0:
            assert cached == 0
        else:
            assert earlier - opener <= cached < usage.prompt_tokens, (turn, earlier, usage)
        earlier = usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})


def test_anthropic_turns_reuse_every_earlier_turn(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    messages: list[dict[str, Any]] = []
    system = SYSTEM + " Answer in one line."  # its own conversation, not the one above
    earlier = 0
    opener = _opener_tokens(url)
    for turn, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        reply = client.messages.create(
            model=MODEL_ID,
            system=system,
            messages=messages,
            max_tokens=6,
            extra_body={"temperature": 0},
        )
        usage = reply.usage
        cached = usage.cache_read_input_tokens or 0
        prompt = usage.input_tokens + cached + (usage.cache_creation_input_tokens or 0)
        if turn == 0:
            assert cached == 0
        else:
            assert earlier - opener <= cached < prompt, (turn, earlier, usage)
        earlier = prompt
        text = "".join(b.text for b in reply.content if b.type == "text")
        messages.append({"role": "assistant", "content": text or "ok"})
