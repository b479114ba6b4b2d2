"""Ways in that a local server closes (gateway/core/exposure.py, issue 27):

- a bind beyond loopback without a key refuses to start unless told
  (--allow-unauthenticated, or its environment variable), distributed serve too;
- a Host outside the allow-list (DNS rebinding) is a 403 in the route's dialect that
  says to use --allowed-hosts;
- a POST a web page may send cross-site unasked (a form, text/plain, no type from a
  browser) is a 415 that says to send application/json;
- /metrics labels come from a fixed set: new methods, paths and unauthenticated
  requests add no series;
- without a key, /metrics and /debug/* answer only clients on this machine;
- a 500 says "internal error" and a request id; the exception's text is only logged.

The servers run SmolLM2's tokenizer and template over a scripted engine.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from gateway.admin.metrics import METHODS
from gateway.app import create_app
from gateway.cli.errors import CliError
from gateway.cli.main import main
from gateway.cli.serve import command, distributed
from gateway.core.exposure import HostPolicy
from gateway.core.settings import ServerSettings
from runtime.engine import RequestHandle
from runtime.types import Finished
from tests.support.anthropic_checks import check_error
from tests.support.hostile_fixtures import no_hub_fixture  # noqa: F401
from tests.support.live_server import live_server
from tests.support.openai_checks import error_of, post, stream
from tests.support.scripted_engine import ScriptRunner, scripted_served

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"
KEY = "sk-exposure"
HELLO = [{"role": "user", "content": "Name three colors."}]
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
CHAT_BODY = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
MESSAGES_BODY = {"model": MODEL, "messages": HELLO, "max_tokens": 2}


@pytest.fixture(scope="module")
def open_url(smollm2_gguf: Path) -> Iterator[str]:
    """No key, loopback bind: the default server."""
    with live_server(lambda: scripted_served(smollm2_gguf, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def keyed_url(smollm2_gguf: Path) -> Iterator[str]:
    settings = ServerSettings(api_key=KEY, allowed_hosts=("tunnel.example",))
    with live_server(lambda: scripted_served(smollm2_gguf, MODEL), settings) as url:
        yield url


def _port(url: str) -> str:
    return url.rsplit(":", 1)[1]


# -- 1. a bind beyond loopback needs a key or --allow-unauthenticated ----------------------------


@pytest.fixture
def reached(monkeypatch: pytest.MonkeyPatch, no_hub: Path) -> list[str]:
    """Where `serve` got to past its checks: the model registry (one model) or
    serve_distributed; each stops the command there."""
    for name in ("API_KEY", "ALLOW_UNAUTHENTICATED", "HOST", "DISTRIBUTED", "MODEL", "CONFIG"):
        monkeypatch.delenv(f"MLX_GATEWAY_{name}", raising=False)
    got: list[str] = []

    def registry(args: Any, settings: Any) -> Any:
        got.append("serve")
        raise CliError("stopped by the test", 1)

    def group(args: Any, settings: Any, server: Any, configs: Any) -> int:
        got.append("distributed")
        return 0

    monkeypatch.setattr(command, "model_registry", registry)
    monkeypatch.setattr(distributed, "serve_distributed", group)
    return got


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "example.com"])
@pytest.mark.parametrize("extra", [[], ["--distributed", "tensor"]])
def test_a_non_loopback_bind_without_a_key_refuses_to_start(
    reached: list[str], capsys: pytest.CaptureFixture[str], host: str, extra: list[str]
) -> None:
    code = main(["serve", "--host", host, *extra])
    err = capsys.readouterr().err
    assert code == 2 and reached == [], err
    [line] = err.splitlines()
    assert f"refusing to listen on {host}" in line
    assert "--api-key" in line and "--allow-unauthenticated" in line


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--host", "0.0.0.0", "--allow-unauthenticated"], {}),
        (["--host", "0.0.0.0"], {"MLX_GATEWAY_ALLOW_UNAUTHENTICATED": "1"}),
        (["--host", "0.0.0.0", "--api-key", "k"], {}),
        (["--host", "0.0.0.0"], {"MLX_GATEWAY_API_KEY": "k"}),
        (["--host", "127.0.0.1"], {}),
        (["--host", "::1"], {}),
        (["--host", "localhost"], {}),
    ],
)
def test_a_key_a_loopback_bind_or_the_flag_lets_it_start(
    reached: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    env: dict[str, str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    main(["serve", *argv])
    assert reached == ["serve"], capsys.readouterr().err
    main(["serve", *argv, "--distributed", "pipeline"])
    assert reached == ["serve", "distributed"]


# -- 2. the Host allow-list ------------------------------------------------------------------


def test_a_loopback_server_answers_only_its_own_host_names(open_url: str) -> None:
    port = _port(open_url)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST", "::1"):
        r = httpx.get(f"{open_url}/v1/models", headers={"host": host})
        assert r.status_code == 200, (host, r.text)
    refused = [
        "evil.example",
        f"evil.example:{port}",
        f"127.0.0.1.nip.io:{port}",
        f"attacker.localhost:{port}",
        f"localhost.evil.example:{port}",
        "10.0.0.5",
    ]
    for host in refused:
        err = error_of(httpx.get(f"{open_url}/v1/models", headers={"host": host}), 403)
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"], host
        assert err["type"] == "permission_error"
        r = post(open_url, MESSAGES, MESSAGES_BODY, {"host": host})
        assert r.status_code == 403
        assert "--allowed-hosts" in check_error(r.json(), "permission_error")
        r = post(open_url, CHAT, CHAT_BODY, {"host": host})
        assert error_of(r, 403)["code"] == "host_not_allowed"  # nothing was generated
    assert post(open_url, CHAT, CHAT_BODY).status_code == 200


def test_allowed_hosts_adds_a_proxy_name(keyed_url: str) -> None:
    auth = {"x-api-key": KEY}
    r = httpx.get(f"{keyed_url}/v1/models", headers={"host": "tunnel.example", **auth})
    assert r.status_code == 200, r.text
    r = httpx.get(f"{keyed_url}/v1/models", headers={"host": "other.example", **auth})
    assert error_of(r, 403)["code"] == "host_not_allowed"


def test_host_policy_beyond_loopback() -> None:
    """Without a key, a server on the network answers IP addresses (a rebinding page
    sends a name) and the listed names; with a key, any Host unless names are listed."""
    bare = HostPolicy.of(ServerSettings(host="0.0.0.0"))
    assert bare.allows("192.168.1.5:8000") and bare.allows("[fe80::1]:8000")
    assert bare.allows("localhost:8000") and not bare.allows("rebind.example:8000")
    named = HostPolicy.of(ServerSettings(host="0.0.0.0", allowed_hosts=("box.local",)))
    assert named.allows("box.local:8000") and not named.allows("rebind.example")
    keyed = HostPolicy.of(ServerSettings(host="0.0.0.0", api_key="k"))
    assert keyed.allows("anything.example")
    keyed_named = HostPolicy.of(ServerSettings(host="::", api_key="k", allowed_hosts=("a.b",)))
    assert keyed_named.allows("a.b:1") and not keyed_named.allows("c.d")
    star = HostPolicy.of(ServerSettings(allowed_hosts=("*",)))
    assert star.allows("anything.example")
    loopback = HostPolicy.of(ServerSettings(host="127.0.0.2"))
    assert loopback.allows("127.0.0.2:9") and not loopback.allows("10.0.0.1")


# -- 3. bodies a web page may send cross-site --------------------------------------------------

SIMPLE_TYPES = [
    "text/plain",
    "text/plain; charset=utf-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
]


@pytest.mark.parametrize("content_type", SIMPLE_TYPES)
def test_a_post_a_browser_can_send_unasked_is_a_415(open_url: str, content_type: str) -> None:
    headers = {"content-type": content_type}
    for path, body in ((CHAT, CHAT_BODY), ("/v1/completions", {"model": MODEL, "prompt": "x"})):
        err = error_of(post(open_url, path, body, headers), 415)
        assert err["code"] == "unsupported_media_type"
        assert "application/json" in err["message"]
    r = post(open_url, MESSAGES, MESSAGES_BODY, headers)
    assert r.status_code == 415
    assert "application/json" in check_error(r.json(), "invalid_request_error")


def test_a_body_with_no_type_is_a_415_only_from_a_browser(open_url: str) -> None:
    data = json.dumps(CHAT_BODY).encode()
    origin = {"origin": "http://evil.example"}
    err = error_of(httpx.post(f"{open_url}{CHAT}", content=data, headers=origin), 415)
    assert "application/json" in err["message"]
    # a script's client (requests' data=, httpx's content=) sends no type and no Origin
    assert httpx.post(f"{open_url}{CHAT}", content=data).status_code == 200
    typed = {"content-type": "application/json; charset=utf-8"}
    assert httpx.post(f"{open_url}{CHAT}", content=data, headers=typed).status_code == 200


# -- 4. metrics labels -------------------------------------------------------------------------


def _series(url: str) -> list[dict[str, str]]:
    """The label sets of mlx_gateway_http_requests_total."""
    text = httpx.get(f"{url}/metrics", headers={"x-api-key": KEY}).text
    return [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mlx_gateway_http_requests_total"
    ]


def _strangers(url: str) -> None:
    """Requests whose method, path and key a client chose: a fresh set each call."""
    tag = uuid.uuid4().hex[:8].upper()
    with httpx.Client() as client:
        for method in (f"BREW{tag}", f"X{tag}", "PROPFIND"):
            client.request(method, f"{url}/v1/models", headers={"x-api-key": KEY})
            client.request(method, f"{url}/{tag}")  # and without the key
        client.get(f"{url}/{tag}/a/b", headers={"x-api-key": KEY})
        client.get(f"{url}/v1/models/{tag}", headers={"x-api-key": KEY})
        client.post(f"{url}{CHAT}", json=CHAT_BODY)  # no key
        client.post(f"{url}{CHAT}", json=CHAT_BODY, headers={"x-api-key": f"wrong-{tag}"})
        client.get(f"{url}/metrics")  # no key


def test_metrics_labels_come_from_a_fixed_set(keyed_url: str) -> None:
    _strangers(keyed_url)
    _series(keyed_url)  # the scrape counts itself from the next one on
    before = _series(keyed_url)
    for _ in range(3):
        _strangers(keyed_url)
    after = _series(keyed_url)
    assert len(after) == len(before), [s for s in after if s not in before]
    routes = {"unmatched", "/v1/models", "/v1/models/{model_id:path}", CHAT, "/metrics"}
    for labels in after:
        assert labels["method"] in METHODS | {"other"}, labels
        assert labels["route"] in routes, labels
    unauthenticated = [s for s in after if s["status"] == "401"]
    assert unauthenticated and all(s["route"] == "unmatched" for s in unauthenticated)


# -- 5. local-only pages -----------------------------------------------------------------------


def test_without_a_key_metrics_and_debug_answer_only_this_machine(
    smollm2_gguf: Path, open_url: str
) -> None:
    app = create_app(lambda: scripted_served(smollm2_gguf, MODEL))
    # no lifespan: the refusal comes before anything that needs the model
    remote = TestClient(
        app, base_url="http://127.0.0.1:8000", client=("203.0.113.7", 5000),
        raise_server_exceptions=False,
    )  # fmt: skip
    for path in ("/metrics", "/debug/prefix-cache", "/debug/prefix-cache?model=x"):
        r = remote.get(path)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "local_only" and "--api-key" in err["message"]
    for path in ("/metrics", "/debug/prefix-cache"):  # on this machine: the page itself
        assert httpx.get(f"{open_url}{path}").status_code != 403


def test_with_a_key_the_local_pages_need_it_from_anywhere(smollm2_gguf: Path) -> None:
    app = create_app(lambda: scripted_served(smollm2_gguf, MODEL), ServerSettings(api_key=KEY))
    with TestClient(app, base_url="http://127.0.0.1:8000", client=("203.0.113.7", 5000)) as remote:
        assert remote.get("/metrics").status_code == 401
        assert remote.get("/metrics", headers={"x-api-key": KEY}).status_code == 200


# -- 6. a 500 names a request id, not the failure ----------------------------------------------

SECRET = "secret-detail-4c1e"


class FailingRunner(ScriptRunner):
    def run(self, handle: RequestHandle) -> Finished:
        raise RuntimeError(f"{SECRET} in the engine")


class BrokenRenderer:
    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"{SECRET} in the renderer")

        return fail


def _request_id(message: str) -> str:
    assert SECRET not in message and message.startswith("internal error (request id req_")
    return message.split("request id ", 1)[1].split(")", 1)[0]


def _logged(caplog: pytest.LogCaptureFixture, request_id: str) -> str:
    """The log records naming `request_id`, tracebacks included."""
    named = [r for r in caplog.records if request_id in r.getMessage()]
    return "\n".join(logging.Formatter().format(record) for record in named)


def test_a_500_says_internal_error_and_a_request_id_that_the_log_carries(
    smollm2_gguf: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    failing = lambda: scripted_served(smollm2_gguf, MODEL, runner=FailingRunner())  # noqa: E731
    broken = lambda: scripted_served(smollm2_gguf, MODEL, renderer=BrokenRenderer())  # noqa: E731
    bodies: list[str] = []
    ids: list[str] = []
    with live_server(failing) as url:
        r = post(url, CHAT, CHAT_BODY)
        err = error_of(r, 500)
        ids.append(_request_id(err["message"]))
        assert r.headers["x-request-id"] == ids[-1] and err["code"] == "generation_failed"
        sse = stream(url, CHAT, CHAT_BODY)  # after the stream began: its error event
        ids.append(_request_id(sse.data[-1]["error"]["message"]))
        r = post(url, MESSAGES, MESSAGES_BODY)
        assert r.status_code == 500
        ids.append(_request_id(check_error(r.json(), "api_error")))
        bodies += [sse.body, r.text]
    with live_server(broken) as url:  # an exception no handler expected
        r = post(url, CHAT, CHAT_BODY)
        ids.append(_request_id(error_of(r, 500)["message"]))
        bodies.append(r.text)
    assert not [b for b in bodies if SECRET in b or "RuntimeError" in b]
    for request_id in ids:
        assert SECRET in _logged(caplog, request_id), request_id
