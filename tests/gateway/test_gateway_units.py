"""Gateway pieces without a model: addresses the CLI prints, API-key headers, per-choice
seeds, request adapters, the Prometheus text, and the CLI's settings."""

from __future__ import annotations

import dataclasses
import json

import pytest
from starlette.datastructures import Headers

from gateway.cli.args import build_parser
from gateway.cli.common import bind_warning, client_url, connectable_host, is_loopback
from gateway.cli.serve.command import server_settings
from gateway.core.auth import key_matches, presented_key
from gateway.core.errors import InvalidRequest
from gateway.core.generation import choice_seed, requests_for
from gateway.core.metrics import Metrics, render
from gateway.core.plan import ChatPlan
from gateway.core.settings import ServerSettings
from gateway.openai import adapt as adapters
from gateway.openai import wire
from gateway.openai.emit import Usage, legacy_logprobs
from runtime.engine import EngineStats
from runtime.types import FinishReason, GenerationStats, SamplingParams, TokenLogprob, TopLogprob


@pytest.mark.parametrize(
    ("host", "expect"),
    [
        ("", "127.0.0.1"),
        ("0.0.0.0", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.1"),
        ("::", "[::1]"),
        ("[::]", "[::1]"),
        ("::1", "[::1]"),
        ("0:0::0", "[::1]"),
        ("192.168.1.5", "192.168.1.5"),
        ("fe80::1", "[fe80::1]"),
        ("example.com", "example.com"),
        ("localhost", "localhost"),
    ],
)
def test_connectable_host(host: str, expect: str) -> None:
    assert connectable_host(host) == expect


def test_printed_url_and_bind_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert client_url("0.0.0.0", 8000) == "http://127.0.0.1:8000/v1"
    assert client_url("::", 9) == "http://[::1]:9/v1"
    monkeypatch.delenv("MLX_GATEWAY_HOST", raising=False)
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"  # loopback by default
    assert bind_warning("127.0.0.1", None) is None and bind_warning("::1", None) is None
    assert bind_warning("0.0.0.0", "key") is None
    for host in ("0.0.0.0", "::", "192.168.1.5"):
        warning = bind_warning(host, None)
        assert warning is not None and "WARNING" in warning and "--api-key" in warning


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.2")


@pytest.mark.parametrize(
    ("headers", "key"),
    [
        ({"authorization": "Bearer sk-1"}, "sk-1"),
        ({"authorization": "bearer  sk-1 "}, "sk-1"),
        ({"x-api-key": "sk-2"}, "sk-2"),
        ({"authorization": "Basic abc", "x-api-key": "sk-3"}, "sk-3"),
        ({"authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_presented_key(headers: dict[str, str], key: str | None) -> None:
    assert presented_key(Headers(headers)) == key


def test_key_matches() -> None:
    assert key_matches("secret", "secret")
    assert not key_matches("secre", "secret") and not key_matches(None, "secret")
    assert not key_matches("sécret", "secret")


def test_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every comparison goes through hmac.compare_digest, whose time does not depend on
    how many leading characters of a guess are right; a plain == would stop at the first
    difference."""
    import hmac

    calls: list[tuple[object, object]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # gateway.core.auth calls it by module
    guesses = ["sk-secret", "sk-secreX", "Xk-secret", "sk", "sk-secret-longer", "sk-sécret"]
    assert [key_matches(g, "sk-secret") for g in guesses] == [True] + [False] * 5
    assert calls == [(g.encode(), b"sk-secret") for g in guesses]


def test_choice_seeds_are_distinct_and_reproducible() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(7, 0) == 7
    seeds = [choice_seed(7, i) for i in range(16)]
    assert len(set(seeds)) == 16 and seeds == [choice_seed(7, i) for i in range(16)]
    reqs = requests_for([1, 2], 4, SamplingParams(seed=-5), ("x",), 3)
    assert [r.sampling.seed for r in reqs] == [choice_seed(-5, i) for i in range(3)]
    assert all(r.prompt_tokens == (1, 2) and r.stop_strings == ("x",) for r in reqs)


def _chat(**fields: object) -> wire.ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return wire.ChatCompletionRequest.model_validate(body)


def _plan(**fields: object) -> ChatPlan:
    return adapters.chat_plan(_chat(**fields), vocab_size=100, tools_supported=False)


def test_chat_plan_honours_fields() -> None:
    plan = _plan(
        n=3,
        max_completion_tokens=5,
        max_tokens=9,
        stop="END",
        seed=1,
        logprobs=True,
        top_logprobs=2,
        logit_bias={"7": -100},
        presence_penalty=0.5,
        frequency_penalty=0.25,
        temperature=0.3,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        reasoning_effort="low",
        chat_template_kwargs={"enable_thinking": False, "x": 1},
        user="u",
        metadata={"k": "v"},
    )
    assert plan.n == 3 and plan.max_tokens == 5 and plan.stop == ("END",)
    s = plan.sampling
    assert (s.seed, s.logprobs, s.top_logprobs, dict(s.logit_bias)) == (1, True, 2, {7: -100.0})
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.3, 0.9, 20, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert plan.options.enable_thinking is False and dict(plan.options.extra) == {"x": 1}
    assert plan.options.reasoning_effort == "low"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"100": 1}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_chat_plan_refuses_by_name(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        _plan(**fields)
    assert (err.value.param or "").startswith(param)


def test_message_shapes() -> None:
    msgs = adapters.to_messages(
        [
            wire.ChatMessage(role="developer", content="d"),
            wire.ChatMessage.model_validate(
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}],
                }
            ),
            wire.ChatMessage.model_validate(
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ),
            wire.ChatMessage(role="tool", content="r", tool_call_id="c"),
            wire.ChatMessage.model_validate(
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}
            ),
            wire.ChatMessage(role="system", content="trailing"),
        ]
    )
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "system"]
    assert msgs[1].content == "ab" and msgs[2].content is None and msgs[4].content == "no"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": None}, "messages[0].content"),
        (
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
            "messages[0].content[0].type",
        ),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
        ({"role": "tool", "content": "r"}, "messages[0].tool_call_id"),
    ],
)
def test_bad_messages_name_the_field(message: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        adapters.to_messages([wire.ChatMessage.model_validate(message)])
    assert err.value.param == param


def _completion(**fields: object) -> adapters.CompletionPlan:
    req = wire.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})
    return adapters.completion_plan(req, vocab_size=100)


def test_completion_plan() -> None:
    assert _completion().max_tokens == 16 and _completion().prompts == ("hi",)
    assert _completion(prompt=[1, 2]).prompts == ((1, 2),)
    assert _completion(prompt=[[1], [2, 3]]).prompts == ((1,), (2, 3))
    assert _completion(prompt=["a", "b"]).prompts == ("a", "b")
    plan = _completion(n=2, best_of=3, logprobs=2)
    assert (plan.n, plan.best_of, plan.sampling.logprobs, plan.sampling.top_logprobs) == (
        2,
        3,
        True,
        2,
    )
    assert _completion(best_of=2).sampling.logprobs  # ranking needs the logprobs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [5, 100]}, "prompt"),
        ({"prompt": [[1], [100]]}, "prompt[1]"),
        ({"suffix": "x"}, "suffix"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_completion_plan_refuses(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        _completion(**fields)
    assert err.value.param == param


def test_usage_counts_the_prompt_once_per_prompt() -> None:
    totals = Usage()
    stats = GenerationStats(prompt_tokens=10, completion_tokens=3, cached_tokens=4)
    totals.add(stats, first_of_prompt=True, reasoning_tokens=1)
    totals.add(GenerationStats(10, 5, 9), first_of_prompt=False)
    body = totals.body()
    assert (body["prompt_tokens"], body["completion_tokens"], body["total_tokens"]) == (10, 8, 18)
    assert body["prompt_tokens_details"] == {"cached_tokens": 4}
    assert body["completion_tokens_details"] == {
        "reasoning_tokens": 1,
        "accepted_prediction_tokens": 0,
        "rejected_prediction_tokens": 0,
    }


def test_legacy_logprobs_offsets() -> None:
    items = [
        TokenLogprob(1, "He", -0.5, (TopLogprob(1, "He", -0.5),)),
        TokenLogprob(2, "llo", -1.0),
    ]
    out = legacy_logprobs(items, 3)
    assert out == {
        "tokens": ["He", "llo"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"He": -0.5}, {}],
        "text_offset": [3, 5],
    }


def test_prometheus_text() -> None:
    metrics = Metrics()
    metrics.request_done("POST", "/v1/chat/completions", 200)
    metrics.request_done("POST", "/v1/chat/completions", 200)
    metrics.first_token(0.07)
    metrics.generation_done(FinishReason.STOP, GenerationStats(10, 5, 4, 0.5, 1.0))
    text = render(metrics, model='a"b', queue_depth=3, engine=EngineStats(requests_total=4))
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])  # "name{labels} value"
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert values['mlx_gateway_info{model="a\\"b"}'] == 1
    route = 'method="POST",route="/v1/chat/completions",status="200"'
    assert values[f"mlx_gateway_http_requests_total{{{route}}}"] == 2
    assert values["mlx_gateway_queue_depth"] == 3 and values["mlx_gateway_generations_total"] == 4
    assert values["mlx_gateway_prefix_cache_hits_total"] == 1
    assert values['mlx_gateway_time_to_first_token_seconds_bucket{le="0.05"}'] == 0
    assert values['mlx_gateway_time_to_first_token_seconds_bucket{le="0.1"}'] == 1
    assert values["mlx_gateway_time_to_first_token_seconds_count"] == 1
    assert values["mlx_gateway_decode_tokens_per_second_count"] == 1
    assert text.endswith("\n")


def test_cli_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "API_KEY",
        "CORS_ORIGINS",
        "MAX_BODY_BYTES",
        "MAX_PROMPT_TOKENS",
        "MAX_TOKENS_CAP",
        "DEFAULT_MAX_TOKENS",
        "STRICT_MAX_TOKENS",
    ):
        monkeypatch.delenv(f"MLX_GATEWAY_{name}", raising=False)
    assert server_settings(build_parser().parse_args(["serve"])) == ServerSettings()
    monkeypatch.setenv("MLX_GATEWAY_API_KEY", "from-env")
    args = build_parser().parse_args(
        ["serve", "--cors-origins", "http://a, http://b", "--max-body-bytes", "1M"]
    )
    settings = server_settings(args)
    assert settings.api_key == "from-env"
    assert settings.cors_origins == ("http://a", "http://b") and settings.max_body_bytes == 1024**2
    args = build_parser().parse_args(
        ["serve", "--api-key", "k", "--max-prompt-tokens", "100", "--max-tokens-cap", "50"]
    )
    settings = server_settings(args)
    assert (settings.api_key, settings.max_prompt_tokens, settings.max_tokens_cap) == ("k", 100, 50)
    with pytest.raises(SystemExit):
        server_settings(build_parser().parse_args(["serve", "--max-tokens-cap", "0"]))
    with pytest.raises(ValueError):
        ServerSettings(api_key=" ")


@pytest.mark.parametrize(
    ("flag", "value"), [("--parser", "nonsense"), ("--template-family", "qwen9")]
)
def test_unknown_parser_or_template_family_is_refused_at_startup(flag: str, value: str) -> None:
    from gateway.cli.common import engine_settings

    args = build_parser().parse_args(["serve", flag, value])
    with pytest.raises(SystemExit, match="unknown"):
        engine_settings(args)


def test_known_overrides_reach_the_engine_settings() -> None:
    from gateway.cli.common import engine_settings

    args = build_parser().parse_args(
        ["serve", "--parser", "hermes", "--template-family", "qwen3", "--prefix-cache-bytes", "1G"]
    )
    settings = engine_settings(args)
    assert (settings.parser, settings.template_family) == ("hermes", "qwen3")
    assert settings.prefix_cache_bytes == 1024**3


def test_forced_named_call_keeps_the_events_its_opener_produced() -> None:
    """The prompt ends inside the call (`tool_call_opener`); for a tool whose arguments
    are all optional the parser has already started the call there, and that start must
    reach the client ahead of the model's own text."""
    from gateway.core.capabilities import tool_call_opener
    from gateway.core.plan import tool_plan as neutral_tool_plan
    from gateway.core.prepare import Prepared, new_parser
    from parsers.events import ToolCallArgs, ToolCallEnd, ToolCallStart
    from templates.types import Tool

    tool = Tool("ping", None, {"type": "object", "properties": {"host": {"type": "string"}}})
    plan = dataclasses.replace(
        _plan(), tools=neutral_tool_plan((tool,), "named", "ping", True, supported=True)
    )
    opener = tool_call_opener("hermes", "ping")
    assert opener is not None
    parser = new_parser(Prepared([], "hermes", False, opener), plan)
    events = parser.feed("}}\n</tool_call>") + parser.finish()
    starts = [e for e in events if isinstance(e, ToolCallStart)]
    assert [s.name for s in starts] == ["ping"]
    args = "".join(e.fragment for e in events if isinstance(e, ToolCallArgs))
    assert json.loads(args) == {}
    assert any(isinstance(e, ToolCallEnd) for e in events)
