"""A sweep of bad inputs over every endpoint in every dialect (issue 27): each is a 4xx
in the route's error shape (OpenAI's ErrorObject, or Anthropic's ErrorResponse with the
type Anthropic gives that status), the server goes on serving, and /metrics gains no
series: the sweep runs twice with fresh client-chosen values (model names, ids, methods,
hosts), and the second pass adds none.

The server runs SmolLM2's tokenizer and template over a scripted engine, with a key.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import ErrorObject
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.metrics import METHODS
from gateway.core.settings import ServerSettings
from tests.support.anthropic_checks import check_error
from tests.support.live_server import live_server
from tests.support.scripted_engine import scripted_served

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
KEY = "sk-sweep"
MAX_BODY = 256 * 1024
HELLO = [{"role": "user", "content": "Name three colors."}]
JSON = {"content-type": "application/json", "x-api-key": KEY}
# Anthropic's error type for each status (docs.anthropic.com, "Errors")
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
}


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    body: dict[str, Any] | None = None  # a valid body (POST)

    @property
    def anthropic(self) -> bool:
        return self.path.startswith("/v1/messages")


POSTS = [
    Endpoint("POST", "/v1/chat/completions", {"model": MODEL, "messages": HELLO, "max_tokens": 2}),
    Endpoint("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    Endpoint("POST", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
    Endpoint("POST", "/v1/messages", {"model": MODEL, "messages": HELLO, "max_tokens": 2}),
    Endpoint("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": HELLO}),
    Endpoint("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    Endpoint("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
]
GETS = [
    Endpoint("GET", "/v1/models"),
    Endpoint("GET", f"/v1/models/{MODEL}"),
    Endpoint("GET", "/metrics"),
    Endpoint("GET", "/debug/prefix-cache"),
]


@dataclass(frozen=True)
class Case:
    """One bad request: what is sent, and the statuses it may get."""

    name: str
    method: str
    path: str
    content: bytes = b""
    headers: dict[str, str] | None = None
    expect: tuple[int, ...] = (400,)


def _post_cases(ep: Endpoint, tag: str) -> list[Case]:
    body = ep.body or {}
    wrong = {k: (v if k == "model" else {"wrong": [None]}) for k, v in body.items()}
    deep = "[" * 100_000 + "]" * 100_000
    padded = {**body, "pad": "x" * (2 * MAX_BODY)}

    def raw(data: Any) -> bytes:
        return json.dumps(data).encode()

    def case(name: str, content: bytes, expect: int = 400, **headers: str) -> Case:
        return Case(name, "POST", ep.path, content, {**JSON, **headers}, (expect,))

    return [
        case("bad JSON", b'{"model": '),
        case("not an object", b"[1, 2, 3]"),
        case("empty body", b""),
        case("NaN", b'{"model": NaN}'),
        case("bad UTF-8", b'{"model": "\xff\xfe"}'),
        case("wrong types", raw(wrong)),
        case("model not a string", raw({**body, "model": [tag]})),
        case("unknown model", raw({**body, "model": f"no-such-model-{tag}"}), 404),
        case("unpaired surrogate", raw({**body, "user": "\ud800"})),
        case("deep body", f'{{"model": "{MODEL}", "x": {deep}}}'.encode()),
        case("huge body", raw(padded), 413),
        case("text/plain", raw(body), 415, **{"content-type": "text/plain"}),
        case("form", raw(body), 415, **{"content-type": "application/x-www-form-urlencoded"}),
        case("bad Host", raw(body), 403, host=f"rebind-{tag}.example"),
        Case("no key", "POST", ep.path, raw(body), {"content-type": "application/json"}, (401,)),
        Case("wrong key", "POST", ep.path, raw(body), {**JSON, "x-api-key": tag}, (401,)),
        Case("wrong method", "PUT", ep.path, raw(body), JSON, (405,)),
        Case("made-up method", f"BREW{tag}", ep.path, raw(body), JSON, (405,)),
    ]


def _get_cases(ep: Endpoint, tag: str) -> list[Case]:
    key = {"x-api-key": KEY}
    return [
        Case("bad Host", "GET", ep.path, headers={**key, "host": f"rebind-{tag}.example"},
             expect=(403,)),
        Case("no key", "GET", ep.path, expect=(401,)),
        Case("wrong method", "POST", ep.path, b"{}", JSON, (405,)),
        Case("made-up method", f"X{tag}", ep.path, headers=key, expect=(405,)),
    ]  # fmt: skip


def _unknown_ids(tag: str) -> list[Case]:
    key = {"x-api-key": KEY}
    return [
        Case("unknown model card", "GET", f"/v1/models/no-such-{tag}", headers=key, expect=(404,)),
        Case("unknown response", "GET", f"/v1/responses/resp_{tag}", headers=key, expect=(404,)),
        Case("delete unknown", "DELETE", f"/v1/responses/resp_{tag}", headers=key, expect=(404,)),
        Case("unknown path", "GET", f"/v1/{tag}/x", headers=key, expect=(404,)),
        Case("unknown model to debug", "GET", f"/debug/prefix-cache?model=no-such-{tag}",
             headers=key, expect=(404,)),
    ]  # fmt: skip


def _cases(tag: str) -> Iterator[Case]:
    for ep in POSTS:
        yield from _post_cases(ep, tag)
    for ep in GETS:
        yield from _get_cases(ep, tag)
    yield from _unknown_ids(tag)


def _check_shape(case: Case, r: httpx.Response) -> None:
    """A 4xx among those expected, in the dialect of its path."""
    assert r.status_code in case.expect, (case.name, case.path, r.status_code, r.text[:300])
    body = r.json()
    if case.path.startswith("/v1/messages") and r.status_code == 413:
        # Anthropic documents request_too_large for a 413; the SDK's ErrorObject union
        # (2.14) does not list it, so its shape is checked here
        assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    elif case.path.startswith("/v1/messages"):
        check_error(body, ANTHROPIC_TYPES.get(r.status_code, "invalid_request_error"))
    else:
        err = ErrorObject.model_validate(body["error"])
        assert err.message and err.type and set(body["error"]) >= {"param", "code"}, body


def _serves(client: httpx.Client, url: str) -> None:
    """Every endpoint answers its valid request."""
    for ep in POSTS:
        r = client.post(f"{url}{ep.path}", json=ep.body, headers={"x-api-key": KEY})
        assert r.status_code == 200, (ep.path, r.text)
    for ep in GETS[:3]:
        assert client.get(f"{url}{ep.path}", headers={"x-api-key": KEY}).status_code == 200


def _sweep(url: str) -> None:
    tag = uuid.uuid4().hex[:10].upper()
    with httpx.Client(timeout=120) as client:
        for case in _cases(tag):
            r = client.request(case.method, f"{url}{case.path}", content=case.content,
                               headers=case.headers)  # fmt: skip
            _check_shape(case, r)
        _serves(client, url)


def _series(url: str) -> list[dict[str, str]]:
    text = httpx.get(f"{url}/metrics", headers={"x-api-key": KEY}).text
    return [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("mlx_gateway_http_requests")
    ]


@pytest.fixture(scope="module")
def url(smollm2_gguf: Path) -> Iterator[str]:
    settings = ServerSettings(api_key=KEY, max_body_bytes=MAX_BODY)
    with live_server(lambda: scripted_served(smollm2_gguf, MODEL), settings) as base:
        yield base


def test_every_bad_input_is_a_4xx_in_its_dialect_and_adds_no_series(url: str) -> None:
    _sweep(url)
    _series(url)  # a scrape counts itself from the next one on
    before = _series(url)
    _sweep(url)
    after = _series(url)
    assert len(after) == len(before), [s for s in after if s not in before]
    for labels in after:
        if "method" in labels:
            assert labels["method"] in METHODS | {"other"}, labels
            assert labels["route"] == "unmatched" or labels["route"].startswith("/"), labels
            assert "BREW" not in labels["route"] and "rebind" not in str(labels), labels
