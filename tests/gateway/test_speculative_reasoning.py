"""Speculative decoding across the end of reasoning: a draft that closes `</think>` too
early, runs on past it, or goes wrong just after it is rejected there, and the reply
(reasoning and content, streamed or not, OpenAI and Anthropic) is the one written with
no speculation at all; a reasoning budget cuts where it cuts without drafts.

The model is arranged: a one-layer Qwen3 with the real Qwen3 tokenizer and chat
template whose attention and MLP write nothing, so each logit row depends on the last
token alone, and whose embeddings and untied head make it write one fixed chain greedily
(`CHAIN`): `<think>`, a sentence of reasoning, `</think>`, an answer, `<|im_end|>`. Every
token of the chain is known, so a prediction or a repeated context can be aimed at the
exact position where reasoning ends. Two servers share the weights: one with speculation
off (the reference; a prediction would still draft there, none is sent to it), one with
the default prompt lookup. Each speculative request must have drafted and had a draft
rejected (the server's counters), so a drafter that never drafts cannot pass."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gateway.core.models.build import build_served
from gateway.core.settings import EngineSettings
from runtime.text.tokenizer import Tokenizer
from tests.support.live_server import live_server
from tests.support.openai_checks import chat_body, chat_chunks, post, stream
from tests.support.speculative_checks import (
    Drafts,
    anthropic_message,
    chat_trace,
    drafts,
    pin_draft_costs,
)

MODEL = "chain-qwen3"
REASONING = "Let me think about it carefully, one small piece at a time."
ANSWER = "The answer is four!"
# the generation prompt ends with "\n"; every token appears once, so each has one successor
CHAIN = ["\n", "<think>", "Let", " me", " think", " about", " it", " carefully", ",", " one",
         " small", " piece", " at", " a", " time", ".", "</think>", "\n\n", "The", " answer",
         " is", " four", "!", "<|im_end|>"]  # fmt: skip
GAIN = 10.0  # the head's weight on a successor: its logit is GAIN * sqrt(hidden), the rest 0


def build_chain_model(tiny_dir: Path, out: Path) -> Path:
    """The tiny Qwen3 at `tiny_dir` rewired to write CHAIN (module docstring): token i of
    the chain embeds as the i-th basis vector, and the head maps it to token i + 1."""
    tok = Tokenizer.from_folder(tiny_dir)
    ids = []
    for piece in CHAIN:
        encoded = tok.encode(piece, add_special_tokens=False)
        assert len(encoded) == 1, f"{piece!r} is not one token: {encoded}"
        ids.append(encoded[0])
    weights = load_file(str(tiny_dir / "model.safetensors"))
    layer = "model.layers.0."
    weights[layer + "self_attn.o_proj.weight"][:] = 0.0
    weights[layer + "mlp.down_proj.weight"][:] = 0.0
    embed = weights["model.embed_tokens.weight"]
    assert len(ids) <= embed.shape[1]
    head = np.zeros_like(embed)
    for i, token in enumerate(ids):
        embed[token] = 0.0
        embed[token, i] = 1.0
        if i + 1 < len(ids):
            head[ids[i + 1], i] = GAIN
    weights["lm_head.weight"] = head
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).symlink_to(tiny_dir / name)
    config = json.loads((tiny_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


@pytest.fixture(scope="module")
def urls(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """(speculation off, prompt lookup): two engines over one loaded model."""
    folder = build_chain_model(tiny_qwen3_dir, tmp_path_factory.mktemp("chain-qwen3"))
    plain = build_served(folder, model_id=MODEL, settings=EngineSettings(speculative="off"))
    drafting = build_served(folder, model_id=MODEL, loaded=plain.loaded)
    pin_draft_costs(drafting)
    with live_server(lambda: plain) as off, live_server(lambda: drafting) as lookup:
        yield off, lookup


CHAT = "/v1/chat/completions"
ASK: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    "max_tokens": 60, "temperature": 0, "stream_options": {"include_usage": True},
}  # fmt: skip


def _chat(base_url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The whole reply (message, finish reason, completion tokens) and the stream's trace."""
    done = chat_body(post(base_url, CHAT, {k: v for k, v in body.items() if k != "stream_options"}))
    choice = done.choices[0]
    assert done.usage is not None
    whole = {
        "message": choice.message.model_dump(exclude_none=True),
        "finish_reason": choice.finish_reason,
        "completion_tokens": done.usage.completion_tokens,
    }
    return whole, chat_trace(chat_chunks(stream(base_url, CHAT, body)))


@pytest.fixture(scope="module")
def chat_reference(urls: tuple[str, str]) -> tuple[dict[str, Any], Any]:
    whole, trace = _chat(urls[0], ASK)
    message = whole["message"]
    assert message["reasoning_content"] == REASONING and message["content"] == ANSWER
    assert whole["finish_reason"] == "stop"
    return whole, trace


PIECES = CHAIN[2:16]  # the reasoning, a token each
assert "".join(PIECES) == REASONING
# where the draft goes wrong, with the drafts' boundaries falling elsewhere relative to
# it in each of a sweep's predictions: where a row's drafts end is the cost model's
# choice, and a mismatch right after a draft is found by the token sampled there,
# without a drafted token to reject
SWEEPS = {
    # aligned from <think> on; drafted: </think> where the model writes piece j
    "closes-early": [f"<think>{''.join(PIECES[:j])}</think>\n\n{ANSWER}"
                     for j in range(0, len(PIECES), 2)],
    # from piece i on (found by n-gram match); drafted: " Then" where the model writes </think>
    "runs-on": [f"{''.join(PIECES[i:])} Then I check it again.</think>\n\n{ANSWER}"
                for i in range(0, len(PIECES) - 1, 2)],
    # drafted across </think> and into the answer, then " five" where the model writes " four"
    "answers-wrong": [f"{''.join(PIECES[i:])}</think>\n\nThe answer is five!"
                      for i in range(1, len(PIECES) - 1, 2)],
}  # fmt: skip


@pytest.mark.parametrize("predictions", SWEEPS.values(), ids=SWEEPS.keys())
def test_a_prediction_crossing_the_reasoning_end_changes_nothing(
    urls: tuple[str, str], chat_reference: tuple[dict[str, Any], Any], predictions: list[str]
) -> None:
    """Streamed and not: the same reasoning_content, content, finish and token count as
    with no speculation, the stream's events in the same order; every request drafted
    and kept some of it, and in at least half of them a draft was rejected."""
    lookup = urls[1]
    whole, trace = chat_reference
    rejecting = 0
    for prediction in predictions:
        body = {**ASK, "prediction": {"type": "content", "content": prediction}}
        before = drafts(lookup)
        done, streamed = _chat(lookup, body)
        spent = drafts(lookup) - before
        assert done == whole, prediction
        assert streamed == trace, prediction
        assert spent.accepted > 0, (prediction, spent)
        rejecting += spent.rejected > 0
    assert rejecting >= len(predictions) // 2, f"{rejecting} of {len(predictions)}"


# (the user's text, which lookup drafts from; the thinking budget; the thinking expected)
CONTEXTS = {
    # the budget closes the reasoning after b tokens; the repeated sentence drafts on
    "budget-cut": [(f"{REASONING} {ANSWER}", b, "".join(PIECES[:b])) for b in range(1, 13, 2)],
    # the reasoning's start, then a close tag (as text) where the model writes on
    "early-close": [(f"{''.join(PIECES[:j])}</think>\n\nThe answer is five!", 1000, REASONING)
                    for j in range(2, len(PIECES), 2)],
}  # fmt: skip


@pytest.mark.parametrize("contexts", CONTEXTS.values(), ids=CONTEXTS.keys())
def test_lookup_drafts_across_the_reasoning_end_change_nothing(
    urls: tuple[str, str], contexts: list[tuple[str, int, str]]
) -> None:
    """Anthropic Messages with thinking: a context that repeats the reasoning has prompt
    lookup draft across its end (a budget's cut, or a close where the model writes on);
    the thinking and text blocks, stop reason, output tokens and the stream's events are
    those of the server that drafts nothing. Every request drafted, and in at least half
    of them a draft was rejected."""
    off, lookup = urls
    rejecting = 0
    for text, budget, thinking in contexts:
        body = {
            "model": MODEL, "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": text}],
            "thinking": {"type": "enabled", "budget_tokens": budget},
        }  # fmt: skip
        whole, trace, none = anthropic_message(off, body)
        assert none == Drafts(0, 0)
        blocks = [(b["type"], b.get("thinking", b.get("text"))) for b in whole["content"]]
        assert blocks == [("thinking", thinking), ("text", ANSWER)]
        assert whole["stop_reason"] == "end_turn"
        drafted_whole, drafted_trace, spent = anthropic_message(lookup, body)
        assert drafted_whole == whole, text
        assert drafted_trace == trace, text
        assert spent.drafted > 0, (text, spent)
        rejecting += spent.rejected > 0
    assert rejecting >= len(contexts) // 2, f"{rejecting} of {len(contexts)}"
