"""Images in requests: the decoding limits (pixel cap checked before decoding, truncated
files, unknown formats, bytes, counts), data: URLs, fetching http(s) URLs (public hosts
only, redirects checked, size capped), and the 400 each dialect answers through a live
server running a tiny Gemma 3 with vision."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

pytest.importorskip("torch")
pytest.importorskip("transformers")

from gateway.core.image_fetch import ImageFetchError, ImagePolicy, read_data_url, read_source
from gateway.core.models.build import build_served
from runtime.vision.preprocess import (
    ImageLimits,
    ImageTooLarge,
    ImageUnreadable,
    TooManyImages,
    open_image,
)
from tests.runtime.models.test_models_vision import save_tiny_vision
from tests.support.live_server import live_server
from tests.support.openai_checks import error_of, post

MODEL = "tiny-gemma3-vision"


def _encoded(fmt: str = "PNG", size: tuple[int, int] = (40, 30), **save: Any) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=fmt, **save)
    return buffer.getvalue()


def _data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares its size and holds no pixel data."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


# -- decoding limits -----------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_pixel_cap_is_checked_before_decoding() -> None:
    # 10000 x 10000 declared, no data: only the header is read before the refusal
    with pytest.raises(ImageTooLarge, match="10000x10000"):
        open_image(_png_header_only(10_000, 10_000), ImageLimits())
    with pytest.raises(ImageTooLarge, match="pixels"):
        open_image(_png_header_only(100_000, 100_000), ImageLimits())  # Pillow's own bomb guard
    with pytest.raises(ImageTooLarge, match="at most 1000"):
        open_image(_encoded(size=(40, 30)), ImageLimits(max_pixels=1000))


def test_truncated_unknown_and_oversized_images_are_refused() -> None:
    png = _encoded()
    with pytest.raises(ImageUnreadable, match="truncated or corrupt"):
        open_image(png[: len(png) // 2], ImageLimits())
    with pytest.raises(ImageUnreadable, match="supported format"):
        open_image(b"certainly not an image", ImageLimits())
    with pytest.raises(ImageUnreadable, match="supported format"):
        open_image(_encoded("TIFF"), ImageLimits())  # decodable, but not accepted
    with pytest.raises(ImageUnreadable, match="empty"):
        open_image(b"", ImageLimits())
    with pytest.raises(ImageTooLarge, match="bytes"):
        open_image(png, ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(TooManyImages, match="at most 2"):
        ImageLimits(max_images=2).check_count(3)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees clockwise
    image = open_image(_encoded("JPEG", size=(40, 30), exif=exif.tobytes()), ImageLimits())
    assert image.size == (30, 40)


def test_data_urls() -> None:
    png = _encoded()
    assert read_data_url(_data_url(png), 1 << 20) == png
    assert read_data_url(_data_url(png).rstrip("="), 1 << 20) == png  # padding optional
    with pytest.raises(ValueError, match="base64"):
        read_data_url("data:image/png,rawbytes", 1 << 20)
    with pytest.raises(ValueError, match="not an image type"):
        read_data_url(_data_url(png, "text/plain"), 1 << 20)
    with pytest.raises(ValueError, match="not valid base64"):
        read_data_url("data:image/png;base64,@@@@", 1 << 20)
    with pytest.raises(ImageTooLarge):
        read_data_url(_data_url(png), len(png) // 2)
    with pytest.raises(ImageFetchError, match="http"):
        read_source("file:///etc/passwd", ImagePolicy())


# -- fetching --------------------------------------------------------------------------


class _Images(BaseHTTPRequestHandler):
    png = _encoded()

    def do_GET(self) -> None:
        routes = {
            "/ok.png": (200, {"Content-Type": "image/png"}, self.png),
            "/to-ok": (302, {"Location": "/ok.png"}, b""),
            "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
            "/loop": (302, {"Location": "/loop"}, b""),
            "/big": (200, {}, b"x" * 5000),
        }
        status, headers, body = routes.get(self.path, (404, {}, b"no"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if self.path != "/big":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path == "/big":
            self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_fetching_refuses_private_hosts_unless_allowed(image_host: str) -> None:
    with pytest.raises(ImageFetchError, match="public hosts only"):
        read_source(f"{image_host}/ok.png", ImagePolicy())
    with pytest.raises(ImageFetchError, match="public hosts only"):
        read_source("http://localhost:9/ok.png", ImagePolicy())
    allowed = ImagePolicy(allow_private=True)
    assert read_source(f"{image_host}/ok.png", allowed) == _Images.png
    assert read_source(f"{image_host}/to-ok", allowed) == _Images.png


def test_fetching_checks_redirects_status_and_size(image_host: str) -> None:
    policy = ImagePolicy(allow_private=True, limits=ImageLimits(max_bytes=4000))
    with pytest.raises(ImageFetchError, match="http or https"):
        read_source(f"{image_host}/to-file", policy)
    with pytest.raises(ImageFetchError, match="redirects"):
        read_source(f"{image_host}/loop", policy)
    with pytest.raises(ImageFetchError, match="HTTP 404"):
        read_source(f"{image_host}/missing", policy)
    with pytest.raises(ImageTooLarge, match="4000"):
        read_source(f"{image_host}/big", policy)  # no Content-Length: counted while read
    with pytest.raises(ImageTooLarge):
        read_source(f"{image_host}/ok.png", ImagePolicy(allow_private=True), used=(64 << 20))


# -- through the server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("vision")
    save_tiny_vision("pooled", folder)
    with live_server(lambda: build_served(folder, model_id=MODEL)) as url:
        yield url


def _chat(url: str, content: list[dict[str, Any]], **extra: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    return post(url, "/v1/chat/completions", {"max_tokens": 2, "temperature": 0, **body})


def _image_part(source: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": source}}


def test_a_chat_image_counts_its_placeholder_tokens(base_url: str) -> None:
    image = _image_part(_data_url(_encoded()))
    text = {"type": "text", "text": "w5 w6"}
    with_image = _chat(base_url, [image, text])
    assert with_image.status_code == 200, with_image.text
    without = _chat(base_url, [text])
    used = with_image.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"]
    assert used == 1 + 4 + 1  # <start_of_image>, 4 image tokens, <end_of_image>
    messages = [{"role": "user", "content": [image, text]}]
    counted = post(base_url, "/tokenize", {"model": MODEL, "messages": messages}).json()
    assert counted["count"] == with_image.json()["usage"]["prompt_tokens"]
    card = httpx.get(f"{base_url}/v1/models/{MODEL}", timeout=30).json()
    assert card["capabilities"]["vision"] is True


@pytest.mark.parametrize(
    ("content", "code", "words"),
    [
        ([_image_part("data:image/png;base64,@@@@")], "invalid_image", "image 1 of 1"),
        ([_image_part(_data_url(b"GIF89a truncated", "image/gif"))], "image_unreadable", "format"),
        ([_image_part(_data_url(_encoded()))] * 17, "too_many_images", "at most 16"),
        ([_image_part("http://127.0.0.1:9/cat.png")], "image_fetch_failed", "public hosts"),
        ([_image_part("ftp://example.com/cat.png")], "image_fetch_failed", "http"),
        (
            [_image_part(_data_url(_encoded())), {"type": "text", "text": "<start_of_image>"}],
            "invalid_image",
            "remove <start_of_image>",
        ),
        (
            [_image_part(_data_url(_encoded())), {"type": "text", "text": "<image_soft_token>"}],
            "invalid_image",
            "placeholder tokens",
        ),
    ],
)
def test_bad_chat_images_are_400s(base_url: str, content: Any, code: str, words: str) -> None:
    err = error_of(_chat(base_url, content), 400)
    assert err["code"] == code and err["param"] == "messages"
    assert words in err["message"]


def test_anthropic_and_responses_answer_400s_in_their_shapes(base_url: str) -> None:
    bad = {"type": "base64", "media_type": "image/png", "data": "@@@@"}
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "image", "source": bad}]}],
    }
    r = post(base_url, "/v1/messages", body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "base64" in r.json()["error"]["message"]
    good = {"type": "base64", "media_type": "image/png", "data": _data_url(_encoded())[22:]}
    content = [{"type": "image", "source": good}, {"type": "text", "text": "w5"}]
    body["messages"][0]["content"] = content  # type: ignore[index]
    counted = post(base_url, "/v1/messages/count_tokens", body)
    assert counted.status_code == 200, counted.text
    body["messages"][0]["content"] = "w5"  # type: ignore[index]
    plain = post(base_url, "/v1/messages/count_tokens", body).json()
    assert counted.json()["input_tokens"] - plain["input_tokens"] == 6
    item = {"type": "input_image", "image_url": "data:image/png;base64,@@@@"}
    request = {"model": MODEL, "input": [{"role": "user", "content": [item]}]}
    err = error_of(post(base_url, "/v1/responses", {**request, "max_output_tokens": 2}), 400)
    assert err["code"] == "invalid_image" and "image 1 of 1" in err["message"]
