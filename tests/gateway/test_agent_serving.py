"""What a real agent session needs around the API (issue 8, sections 4 and 5): max_tokens
clamped to the context's room (or refused with --strict-max-tokens), a default output
bound, the model's own sampling defaults, model aliases, prompt_cache_key pins, and the
prefix cache's account of why each request missed.

Live tests serve the tiny random Qwen3 (real tokenizer and template) with a 256-token
context, so a request can reach the end of the context in a fraction of a second; EOS is
biased away where a test needs the generation to run to its bound.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
from gguf import GGUFWriter  # noqa: E402
from openai.types import Model  # noqa: E402

from gateway.cli.args import build_parser  # noqa: E402
from gateway.cli.serve.command import model_aliases, server_settings  # noqa: E402
from gateway.core.errors import InvalidRequest  # noqa: E402
from gateway.core.generation import budget, requests_for  # noqa: E402
from gateway.core.models.build import build_served, sampling_defaults  # noqa: E402
from gateway.core.models.served import ServedModel  # noqa: E402
from gateway.core.plan import CachePin  # noqa: E402
from gateway.core.prepare import prepare  # noqa: E402
from gateway.core.settings import DEFAULT_MAX_TOKENS, ServerSettings  # noqa: E402
from gateway.openai import adapt as adapters  # noqa: E402
from gateway.openai import wire  # noqa: E402
from runtime.load import LoadedModel  # noqa: E402
from runtime.load.gguf.loader import gguf_generation_config  # noqa: E402
from runtime.load.gguf.reader import GGUFFile  # noqa: E402
from runtime.types import PrefixPin, SamplingParams  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.openai_checks import chat_body, error_of, post  # noqa: E402

MODEL = "tiny-qwen3"
ALIASES = frozenset({"claude-sonnet-4-5", "claude-haiku-4-5"})
CONTEXT = 256
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there"}]
NO_EOS = {"151643": -100, "151645": -100}  # <|endoftext|>, <|im_end|>: run to the bound
QWEN3_SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


def _variant(src: Path, out: Path, generation: dict[str, Any]) -> Path:
    """The tiny Qwen3 with a 256-token context and the given generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).symlink_to(src / name)
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


@pytest.fixture(scope="module")
def sampling_dir(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _variant(tiny_qwen3_dir, tmp_path_factory.mktemp("sampling"), QWEN3_SAMPLING)


@pytest.fixture(scope="module")
def greedy_dir(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _variant(tiny_qwen3_dir, tmp_path_factory.mktemp("greedy"), {"do_sample": False})


@pytest.fixture(scope="module")
def served(sampling_dir: Path) -> ServedModel:
    return build_served(sampling_dir, model_id=MODEL, aliases=ALIASES)


LENIENT = ServerSettings(default_max_tokens=8)


@pytest.fixture(scope="module")
def url(greedy_dir: Path) -> Iterator[str]:
    load = lambda: build_served(greedy_dir, model_id=MODEL, aliases=ALIASES)  # noqa: E731
    with live_server(load, LENIENT) as base:
        yield base


@pytest.fixture(scope="module")
def strict_url(greedy_dir: Path) -> Iterator[str]:
    settings = ServerSettings(strict_max_tokens=True, max_tokens_cap=CONTEXT + 44)
    with live_server(lambda: build_served(greedy_dir, model_id=MODEL), settings) as base:
        yield base


def _chat(base: str, **fields: Any) -> httpx.Response:
    return post(base, CHAT, {"model": MODEL, "messages": HELLO, **fields})


def _prompt_tokens(base: str, messages: list[dict[str, str]]) -> int:
    return int(httpx.post(f"{base}/tokenize", json={"messages": messages}).json()["count"])


# -- the output budget ----------------------------------------------------------------------


def test_budget_clamps_by_default(served: ServedModel) -> None:
    settings = ServerSettings()
    room = CONTEXT - 100
    assert budget(served, settings, 100, 32000) == room  # opencode's and Claude Code's ask
    assert budget(served, settings, 100, 10) == 10
    assert budget(served, settings, 100, None) == min(room, DEFAULT_MAX_TOKENS)
    capped = ServerSettings(max_tokens_cap=50, default_max_tokens=70)
    assert budget(served, capped, 100, 32000) == 50  # over the cap: clamped too
    assert budget(served, capped, 100, None) == 50
    assert budget(served, ServerSettings(default_max_tokens=None), 10, None) == CONTEXT - 10


def test_budget_refuses_what_cannot_fit(served: ServedModel) -> None:
    strict = ServerSettings(strict_max_tokens=True, max_tokens_cap=50)
    with pytest.raises(InvalidRequest) as over_cap:
        budget(served, strict, 100, 51)
    assert over_cap.value.code == "max_tokens_too_large" and over_cap.value.param == "max_tokens"
    with pytest.raises(InvalidRequest) as over_room:
        budget(served, ServerSettings(strict_max_tokens=True), 100, CONTEXT, param="max_tokens")
    assert over_room.value.code == "context_length_exceeded"
    assert "--strict-max-tokens" in over_room.value.message
    for settings in (ServerSettings(), strict):
        with pytest.raises(InvalidRequest) as alone:
            budget(served, settings, CONTEXT + 4, 10, prompt_param="input")
        # one token must be left for the reply: 256 + 4 tokens are 5 over
        assert alone.value.code == "context_length_exceeded" and alone.value.param == "input"
        assert "5 tokens over" in alone.value.message and "Shorten the input" in alone.value.message


def test_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DEFAULT_MAX_TOKENS", "STRICT_MAX_TOKENS", "MODEL_ALIAS"):
        monkeypatch.delenv(f"MLX_GATEWAY_{name}", raising=False)
    plain = build_parser().parse_args(["serve"])
    assert server_settings(plain).default_max_tokens == DEFAULT_MAX_TOKENS
    assert not server_settings(plain).strict_max_tokens and model_aliases(plain) == frozenset()
    args = build_parser().parse_args(
        ["serve", "--strict-max-tokens", "--default-max-tokens", "0", "--model-alias", "a",
         "--model-alias", "b,c"]
    )  # fmt: skip
    settings = server_settings(args)
    assert settings.strict_max_tokens and settings.default_max_tokens is None  # 0: no bound
    assert model_aliases(args) == {"a", "b", "c"}
    monkeypatch.setenv("MLX_GATEWAY_STRICT_MAX_TOKENS", "true")
    monkeypatch.setenv("MLX_GATEWAY_DEFAULT_MAX_TOKENS", "2048")
    monkeypatch.setenv("MLX_GATEWAY_MODEL_ALIAS", "claude-sonnet-4-5, claude-haiku-4-5")
    from_env = build_parser().parse_args(["serve"])
    assert server_settings(from_env).strict_max_tokens
    assert server_settings(from_env).default_max_tokens == 2048
    assert model_aliases(from_env) == ALIASES
    assert model_aliases(build_parser().parse_args(["serve", "--model-alias", "x"])) == {"x"}
    with pytest.raises(SystemExit):
        server_settings(build_parser().parse_args(["serve", "--default-max-tokens", "-3"]))


# -- sampling defaults ------------------------------------------------------------------


def test_sampling_defaults_follow_generation_config() -> None:
    assert sampling_defaults(QWEN3_SAMPLING) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert sampling_defaults({"do_sample": False, "temperature": 0.7}) == {"temperature": 0.0}
    assert sampling_defaults({"eos_token_id": 2}) == {}
    # out of range or of the wrong type: left to the request / neutral values
    bad = {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": "0.1", "repetition_penalty": 1.1}
    assert sampling_defaults(bad) == {"repetition_penalty": 1.1}


def test_loader_reads_the_models_sampling(served: ServedModel, tmp_path: Path) -> None:
    assert isinstance(served.loaded, LoadedModel)
    assert served.loaded.generation_config["top_k"] == 20
    assert served.sampling_defaults == sampling_defaults(QWEN3_SAMPLING)
    path = tmp_path / "meta.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.add_string("general.sampling.sequence", "edkypmxt")  # not a number: skipped
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = gguf_generation_config(GGUFFile(path).metadata)
    assert config == {"temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}
    assert sampling_defaults(config) == config


def test_model_defaults_apply_when_a_request_leaves_them_out(url: str) -> None:
    # the served folder says do_sample: false, so an unseeded request without a
    # temperature is greedy: the same reply every time (sampling would differ at random)
    replies = {chat_body(_chat(url, max_tokens=12)).choices[0].message.content for _ in range(3)}
    assert len(replies) == 1
    sampled = {
        chat_body(_chat(url, max_tokens=12, temperature=1.0)).choices[0].message.content
        for _ in range(3)
    }
    assert len(sampled) > 1  # the request's own field wins


# -- pins ------------------------------------------------------------------------------


def test_requests_carry_the_pin() -> None:
    reqs = requests_for([1, 2], 4, SamplingParams(), (), 2, pin=CachePin(ttl=3600))
    assert [r.pin for r in reqs] == [PrefixPin(ttl=3600, key=None)] * 2
    assert requests_for([1, 2], 4, SamplingParams(), (), 1)[0].pin is None
    req = wire.ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": HELLO, "prompt_cache_key": "session-7"}
    )
    plan = adapters.chat_plan(req, vocab_size=100, tools_supported=False)
    assert plan.pin == CachePin(ttl=300, key="session-7")


def test_requests_carry_the_message_starts(served: ServedModel) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    req = wire.ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
    plan = adapters.chat_plan(req, vocab_size=100, tools_supported=False)
    prep = prepare(served, plan)
    opener = served.loaded.tokenizer.token_to_id("<|im_start|>")
    # every message and the generation prompt open with <|im_start|>; the first is at 0
    assert prep.boundaries == tuple(i for i, t in enumerate(prep.tokens) if t == opener)[1:]
    assert len(prep.boundaries) == len(messages)
    reqs = requests_for(prep.tokens, 4, SamplingParams(), (), 1, boundaries=prep.boundaries)
    assert reqs[0].boundaries == prep.boundaries


# -- over the wire ---------------------------------------------------------------------


def test_models_list_every_name_with_the_bounds(url: str) -> None:
    data = httpx.get(f"{url}/v1/models").json()["data"]
    assert [Model.model_validate(m).id for m in data] == [MODEL, *sorted(ALIASES)]
    main = data[0]
    assert main["aliases"] == sorted(ALIASES) and "alias_of" not in main
    assert main["context_length"] == CONTEXT and main["max_tokens_default"] == 8
    assert main["max_output_tokens"] == CONTEXT - 1
    assert main["sampling_defaults"] == {"temperature": 0.0}
    assert all(m["alias_of"] == MODEL for m in data[1:])
    one = httpx.get(f"{url}/v1/models/claude-haiku-4-5").json()
    assert one["id"] == "claude-haiku-4-5" and one["alias_of"] == MODEL


def test_an_alias_is_served_and_an_unknown_name_says_how(url: str) -> None:
    body = chat_body(post(url, CHAT, {"model": "claude-haiku-4-5", "messages": HELLO}))
    assert body.choices[0].message.content is not None
    err = error_of(post(url, CHAT, {"model": "claude-opus-4-1", "messages": HELLO}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    for name in (MODEL, *ALIASES):
        assert repr(name) in err["message"]
    assert "--model-alias claude-opus-4-1" in err["message"]


def test_max_tokens_beyond_the_context_is_clamped(url: str) -> None:
    body = chat_body(_chat(url, max_tokens=32000, temperature=0, logit_bias=NO_EOS))
    assert body.usage is not None and body.choices[0].finish_reason == "length"
    assert body.usage.prompt_tokens + body.usage.completion_tokens == CONTEXT


def test_a_request_without_a_limit_gets_the_default_bound(url: str) -> None:
    body = chat_body(_chat(url, temperature=0, logit_bias=NO_EOS))
    assert body.usage is not None and body.choices[0].finish_reason == "length"
    assert body.usage.completion_tokens == LENIENT.default_max_tokens


def test_a_prompt_that_alone_does_not_fit_is_refused(url: str) -> None:
    long = [{"role": "user", "content": "word " * 300}]
    over = _prompt_tokens(url, long) - (CONTEXT - 1)
    err = error_of(post(url, CHAT, {"model": MODEL, "messages": long, "max_tokens": 5}), 400)
    assert err["code"] == "context_length_exceeded" and f"{over} tokens over" in err["message"]


def test_strict_max_tokens_keeps_openais_400(strict_url: str) -> None:
    err = error_of(_chat(strict_url, max_tokens=CONTEXT), 400)
    assert err["code"] == "context_length_exceeded"
    err = error_of(_chat(strict_url, max_completion_tokens=CONTEXT + 45), 400)
    assert err["code"] == "max_tokens_too_large" and err["param"] == "max_completion_tokens"
    body = chat_body(_chat(strict_url, max_tokens=3))
    assert body.usage is not None and body.usage.completion_tokens <= 3


def test_cache_misses_are_explained(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="runtime.engine.runner")
    system = {"role": "system", "content": "You answer about the weather."}
    first = [system, {"role": "user", "content": "Is it raining in Paris?"}]
    second = [system, {"role": "user", "content": "Is it snowing in Oslo?"}]
    chat_body(post(url, CHAT, {"model": MODEL, "messages": first, "max_tokens": 2}))
    req = {"model": MODEL, "messages": second, "max_tokens": 2, "prompt_cache_key": "weather"}
    reply = chat_body(post(url, CHAT, req))
    view = httpx.get(f"{url}/debug/prefix-cache").json()
    last = view["recent"][-1]
    assert last["reason"] == "diverged" and last["pin"] == "ttl=300s key=weather"
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert last["reused"] == last["matched"] == reply.usage.prompt_tokens_details.cached_tokens
    # the text on each side of the first differing token, decoded
    div = last["divergence"]
    assert div["at"] == last["matched"] and "snow" in div["request"] and "rain" in div["cached"]
    assert "Is it" in div["before"]
    assert view["pins"][0]["key"] == "weather" and view["pins"][0]["ttl_seconds"] == 300
    assert view["stats"]["pins"] == 1 and view["trie"]
    lines = [r.getMessage() for r in caplog.records if "cache diverged" in r.getMessage()]
    assert lines and "snow" in lines[-1]
