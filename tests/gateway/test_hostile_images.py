"""Hostile images: URLs at loopback, private or link-local hosts (by address, by name,
by redirect, by a DNS answer that changes) or with other schemes are a 400 in each
dialect unless the server runs with --allow-private-urls; decompression bombs,
truncated and unknown images are a 400 that says what is wrong. The servers run a tiny
random Gemma 3 with vision; the image host is a local HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cli.main import main
from gateway.core.models.build import build_served
from tests.support.anthropic_checks import check_error
from tests.support.hostile_fixtures import no_hub_fixture, opened_fixture  # noqa: F401
from tests.support.live_server import live_server
from tests.support.openai_checks import error_of, post

CHAT = "/v1/chat/completions"


# -- URLs the server must not fetch ------------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    """An image host on loopback; counts the requests it gets."""

    hits: list[str] = []  # noqa: RUF012 - one list for the module's one server
    png = b""

    def do_GET(self) -> None:
        self.hits.append(self.path)
        routes = {
            "/ok.png": (200, {"Content-Type": "image/png"}, self.png),
            "/to-ok": (302, {"Location": "/ok.png"}, b""),
            "/to-metadata": (302, {"Location": "http://169.254.169.254/latest/"}, b""),
            "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        }
        status, headers, body = routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _png(size: tuple[int, int] = (40, 30)) -> bytes:

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    _Images.png = _png()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


VMODEL = "tiny-gemma3-vision"


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two servers of a tiny Gemma 3 with vision: the default policy, and one started as
    --allow-private-urls starts it."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gateway.core.settings import EngineSettings
    from tests.runtime.models.test_models_vision import save_tiny_vision

    folder = tmp_path_factory.mktemp("vision")
    save_tiny_vision("pooled", folder)
    allowed = EngineSettings(allow_private_urls=True)
    with (
        live_server(lambda: build_served(folder, model_id=VMODEL)) as default_url,
        live_server(lambda: build_served(folder, model_id=VMODEL, settings=allowed)) as open_url,
    ):
        yield default_url, open_url


def _image_requests(source: str) -> list[tuple[str, dict[str, Any]]]:
    """The same image in each dialect's way of sending one."""
    chat = [{"type": "image_url", "image_url": {"url": source}}, {"type": "text", "text": "w5"}]
    if source.startswith("data:"):
        media, data = source[5:].split(";base64,")
        src: dict[str, Any] = {"type": "base64", "media_type": media, "data": data}
    else:
        src = {"type": "url", "url": source}
    anthropic = [{"type": "image", "source": src}, {"type": "text", "text": "w5"}]
    responses = [{"type": "input_image", "image_url": source}, {"type": "input_text", "text": "w5"}]
    return [
        (CHAT, {"model": VMODEL, "max_tokens": 2, "messages": [{"role": "user", "content": chat}]}),
        (
            "/v1/messages",
            {
                "model": VMODEL,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": anthropic}],
            },
        ),
        (
            "/v1/responses",
            {
                "model": VMODEL,
                "max_output_tokens": 2,
                "input": [{"role": "user", "content": responses}],
            },
        ),
    ]


def _refused(r: httpx.Response, path: str) -> str:
    """The message of a 400 in the dialect of `path`."""
    assert r.status_code == 400, r.text
    if path.startswith("/v1/messages"):
        return check_error(r.json(), "invalid_request_error")
    err = error_of(r, 400)
    assert err["param"] in ("messages", "input") and err["type"] == "invalid_request_error"
    return str(err["message"])


def _private_urls(host: str) -> list[str]:
    port = host.rsplit(":", 1)[1]
    return [
        f"{host}/ok.png",  # loopback
        f"http://localhost:{port}/ok.png",  # a name that resolves to loopback
        f"http://[::1]:{port}/ok.png",
        f"http://[::ffff:127.0.0.1]:{port}/ok.png",
        f"http://2130706433:{port}/ok.png",  # 127.0.0.1 as one number
        f"http://0.0.0.0:{port}/ok.png",  # unspecified
        "http://169.254.169.254/latest/meta-data/",  # cloud metadata (link-local)
        "http://10.1.2.3/x.png",
        "http://172.16.0.1/x.png",
        "http://172.31.255.254/x.png",
        "http://192.168.1.1/x.png",
        "http://100.64.0.1/x.png",  # shared address space
        "http://[fc00::1]/x.png",
        "http://[fd12:3456::1]/x.png",
        "http://[fe80::1]/x.png",
        "http://[::]/x.png",
        "http://[2002:a00:1::]/x.png",  # 6to4 of 10.0.0.1
        "http://[64:ff9b::a9fe:a9fe]/x.png",  # NAT64 of 169.254.169.254
    ]


OTHER_SCHEMES = [
    "file:///etc/passwd",
    "ftp://example.com/x.png",
    "gopher://127.0.0.1:70/_x",
    "javascript:alert(1)",
    "//127.0.0.1/x.png",
    "/etc/passwd",
]


def test_private_and_non_http_image_urls_are_400s_in_every_dialect(
    vision: tuple[str, str], image_host: str, opened: list[str]
) -> None:
    default_url, _ = vision
    _Images.hits.clear()
    for source in _private_urls(image_host):
        for path, body in _image_requests(source):
            message = _refused(post(default_url, path, body), path)
            assert "public hosts only" in message and "--allow-private-urls" in message
    for source in OTHER_SCHEMES:
        for path, body in _image_requests(source):
            assert "http" in _refused(post(default_url, path, body), path)
    assert _Images.hits == []  # nothing was fetched
    assert not [p for p in opened if "passwd" in p]


def test_allow_private_urls_fetches_them(vision: tuple[str, str], image_host: str) -> None:
    _, open_url = vision
    _Images.hits.clear()
    for source in (f"{image_host}/ok.png", f"{image_host}/to-ok"):
        for path, body in _image_requests(source):
            r = post(open_url, path, body)
            assert r.status_code == 200, r.text
    assert _Images.hits.count("/ok.png") == 6 and _Images.hits.count("/to-ok") == 3
    # a redirect is checked like the first URL, even here
    for path, body in _image_requests(f"{image_host}/to-file"):
        assert "http or https" in _refused(post(open_url, path, body), path)


def _header_only_png(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixels: a few dozen bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def _data(data: bytes, media: str = "image/png") -> str:

    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_bombs_and_broken_images_are_400s_that_say_what_is_wrong(vision: tuple[str, str]) -> None:
    default_url, _ = vision
    png = _png()
    cases = [
        (_data(_header_only_png(30_000, 30_000)), "too many pixels"),
        (_data(_header_only_png(8_000, 8_000)), "8000x8000 = 64000000 pixels; at most"),
        (_data(png[: len(png) // 2]), "truncated or corrupt"),
        (_data(b"certainly not an image"), "not an image in a supported format"),
        (_data(b"GIF89a" + b"\x00" * 20, "image/gif"), "format"),
        (_data(b"II*\x00" + b"\x00" * 64, "image/tiff"), "not an image in a supported format"),
    ]
    for source, says in cases:
        for path, body in _image_requests(source):
            message = _refused(post(default_url, path, body), path)
            assert says in message and "image 1 of 1" in message, message
    r = post(default_url, *_image_requests(_data(png))[0])
    assert r.status_code == 200, r.text  # and the server goes on


def _resolving(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> list[str]:
    """getaddrinfo answering `answers[host]` in turn (other hosts resolve as usual);
    returns the hosts asked for."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def fake(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in answers:
            return real(host, port, *args, **kwargs)
        asked.append(host)
        address = answers[host][min(len(asked), len(answers[host])) - 1]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


def test_names_are_checked_by_the_addresses_they_resolve_to(
    monkeypatch: pytest.MonkeyPatch, image_host: str
) -> None:
    from gateway.core.image_fetch import ImageFetchError, ImagePolicy, read_source

    port = image_host.rsplit(":", 1)[1]
    _resolving(
        monkeypatch,
        {
            "metadata.example": ["169.254.169.254"],
            "intranet.example": ["10.0.0.7"],
            "v6.example": ["fd00::7"],
            "images.example": ["127.0.0.1"],
        },
    )
    for host in ("metadata.example", "intranet.example", "v6.example", "images.example"):
        with pytest.raises(ImageFetchError, match="public hosts only"):
            read_source(f"http://{host}:{port}/ok.png", ImagePolicy())
    # allowed: the connection goes to the address checked, the name stays the Host
    _Images.hits.clear()
    got = read_source(f"http://images.example:{port}/ok.png", ImagePolicy(allow_private=True))
    assert got == _Images.png and _Images.hits == ["/ok.png"]


def test_the_address_connected_to_is_the_one_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """DNS rebinding: a name that answers a public address to the check and loopback
    afterwards is still connected at the public one, resolved once."""
    from gateway.core.image_fetch import ImageFetchError, ImagePolicy, read_source

    asked = _resolving(monkeypatch, {"rebind.example": ["93.184.216.34", "127.0.0.1"]})
    dialed: list[tuple[str, int]] = []

    def dial(address: tuple[str, int], *args: Any, **kwargs: Any) -> socket.socket:
        dialed.append(address)
        raise OSError("no network in tests")

    monkeypatch.setattr(socket, "create_connection", dial)
    with pytest.raises(ImageFetchError, match="could not be fetched"):
        read_source("http://rebind.example/cat.png", ImagePolicy())
    assert asked == ["rebind.example"] and dialed == [("93.184.216.34", 80)]


def test_redirects_to_private_hosts_or_other_schemes_are_refused(
    monkeypatch: pytest.MonkeyPatch, image_host: str
) -> None:
    """As if the image host were public: where it redirects is checked again."""
    from gateway.core import image_fetch
    from gateway.core.image_fetch import ImageFetchError, ImagePolicy, read_source

    public = image_fetch._public
    monkeypatch.setattr(image_fetch, "_public", lambda a: a == "127.0.0.1" or public(a))
    assert read_source(f"{image_host}/to-ok", ImagePolicy()) == _Images.png
    with pytest.raises(ImageFetchError, match=r"'169\.254\.169\.254'.*public hosts only"):
        read_source(f"{image_host}/to-metadata", ImagePolicy())
    with pytest.raises(ImageFetchError, match="http or https"):
        read_source(f"{image_host}/to-file", ImagePolicy())


def test_allow_private_urls_flag_reaches_the_served_models(
    monkeypatch: pytest.MonkeyPatch, no_hub: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli.errors import CliError
    from gateway.cli.serve import command

    seen: list[bool] = []

    def registry(args: Any, settings: Any) -> Any:
        seen.append(settings.allow_private_urls)
        raise CliError("stopped before loading")

    monkeypatch.setattr(command, "model_registry", registry)
    assert main(["serve", "--allow-private-urls"]) == 2
    assert main(["serve"]) == 2
    monkeypatch.setenv("MLX_GATEWAY_ALLOW_PRIVATE_URLS", "1")
    assert main(["serve"]) == 2
    assert seen == [True, False, True]
    assert capsys.readouterr().err.count("stopped before loading") == 3
