"""The browser page (gateway/ui/) in a real headless Chromium (Debian's `chromium`, driven
by Playwright; `.ci/run` installs it), served with the tiny random Qwen3: with and
without a key, a streamed chat, two conversations sharing a prefix in the trie view, two
running streams in the batch view, safe markdown, and no console errors anywhere.

Each view is saved as a screenshot under the test's temporary folder, and also into
$MLX_GATEWAY_SCREENS when it is set. Every wait is for a condition in the page."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from gateway.core.models.build import build_served  # noqa: E402
from gateway.core.settings import ServerSettings  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.types import Finished, FinishReason, GenerationStats, TextDelta  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.long_chat import LongChat  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Chromium (apt-get install chromium)"
)

MODEL = "tiny-qwen3"
KEY = "page-test-key"
WAIT_MS = 60_000
SYSTEM = "You are a patient assistant for a garden centre; answer in one short sentence. " * 3


@pytest.fixture(scope="module")
def url(tiny_qwen3_dir: Path) -> Iterator[str]:
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL)) as base:
        yield base


@pytest.fixture(scope="module")
def keyed_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    settings = ServerSettings(api_key=KEY)
    with live_server(lambda: build_served(tiny_qwen3_dir, model_id=MODEL), settings) as base:
        yield base


@pytest.fixture(scope="module")
def browser(url: str, keyed_url: str, tool_url: str) -> Iterator[Any]:
    # after the servers: closed before them, so no open event stream holds a server up
    with sync_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh tab; the test fails on any console error or uncaught exception in it."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(WAIT_MS)
    errors: list[str] = []
    tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    yield tab
    context.close()
    assert errors == [], f"errors in the browser's console: {errors}"


def screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    extra = os.environ.get("MLX_GATEWAY_SCREENS")
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(extra) / path.name)
    return path


def send(page: Any, text: str) -> Any:
    """Send a message; the reply's element once it has finished (its stats shown)."""
    replies = page.locator(".msg.assistant")
    before = replies.count()
    page.fill("#prompt", text)
    page.click("#send")
    reply = replies.nth(before)
    reply.locator(".stats").wait_for()
    return reply


# -- the page and its key ------------------------------------------------------------------


def test_api_clients_keep_their_answers_at_the_root(url: str) -> None:
    for method in ("GET", "HEAD"):
        r = httpx.request(method, url + "/", headers={"accept": "application/json"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert httpx.get(url + "/").json() == {"name": "mlx-gateway", "status": "ok"}
    assert (
        httpx.head(url + "/", headers={"accept": "text/html"}).headers["content-type"]
        == "application/json"
    )  # Claude Code's probe, whatever it accepts
    page = httpx.get(url + "/", headers={"accept": "text/html,*/*"})
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe" not in csp
    assert httpx.get(url + "/ui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/ui/nope.js").status_code == 404


def test_without_a_key_the_page_opens_on_the_chat(page: Any, url: str, tmp_path: Path) -> None:
    response = page.goto(url + "/")
    assert "default-src 'self'" in response.headers["content-security-policy"]
    page.locator("#view-chat").wait_for()
    assert page.locator("#login").is_hidden()
    assert page.locator("#model option").first.get_attribute("value") == MODEL
    page.locator("#live-status", has_text="engine: live").wait_for()


def test_with_a_key_nothing_shows_until_it_is_given(
    page: Any, keyed_url: str, tmp_path: Path
) -> None:
    page.goto(keyed_url + "/")
    page.locator("#login-form").wait_for()
    assert page.locator("#app").is_hidden() and page.locator("#nav").is_hidden()
    screenshot(page, tmp_path, "login")
    page.fill("#key", KEY)
    page.click("#login-form button")
    page.locator("#view-chat").wait_for()
    page.locator("#live-status", has_text="engine: live").wait_for()
    assert page.evaluate("sessionStorage.getItem('mlx-gateway-key')") == KEY
    page.fill("#max_tokens", "4")
    reply = send(page, "Hello there.")  # the key travels with the chat too
    assert reply.locator(".stats").get_attribute("data-generated") not in (None, "–")
    page.reload()  # asked once: the tab keeps it
    page.locator("#view-chat").wait_for()
    assert page.locator("#login").is_hidden()


# -- chat ------------------------------------------------------------------------------------


def test_a_chat_reply_streams_in(page: Any, url: str, tmp_path: Path) -> None:
    page.goto(url + "/#chat")
    page.fill("#system", SYSTEM)
    page.fill("#max_tokens", "60000")  # runs until stopped
    page.fill("#prompt", "Write about **roses**.")
    page.click("#send")
    # text arrives while the reply is still running
    page.wait_for_function(
        """() => !document.querySelector('#stop-reply').disabled &&
                 (document.querySelector('.msg.assistant .md')?.textContent.length ?? 0) > 20"""
    )
    page.click("#stop-reply")
    stats = page.locator(".msg.assistant .stats")
    stats.wait_for()
    assert "stopped" in stats.inner_text()
    assert page.locator(".msg.user .text").inner_text() == "Write about **roses**."
    screenshot(page, tmp_path, "chat")


def test_markdown_is_built_as_text(page: Any, url: str) -> None:
    page.goto(url + "/")
    page.locator("#view-chat").wait_for()
    out = page.evaluate(
        """async () => {
            const { renderMarkdown } = await import('/ui/markdown.js');
            const box = document.createElement('div');
            box.append(renderMarkdown([
                '# Title', '<img src=x onerror="window.hacked=1">', '**bold** and `<b>code</b>`',
                '[bad](javascript:alert(1)) [good](https://example.com)',
                '```html', '<script>window.hacked=1</script>', '```', '- one', '- two',
            ].join('\\n')));
            document.body.append(box);
            const tags = [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase());
            return { tags, text: box.textContent, links: [...box.querySelectorAll('a')].map((a) => a.href),
                     hacked: window.hacked ?? null };
        }"""
    )
    assert "img" not in out["tags"] and "script" not in out["tags"] and "b" not in out["tags"]
    assert {"h3", "strong", "code", "pre", "ul", "li"} <= set(out["tags"])
    assert '<img src=x onerror="window.hacked=1">' in out["text"]
    assert out["links"] == ["https://example.com/"] and out["hacked"] is None


# -- the trie and the batch ------------------------------------------------------------------


def test_two_conversations_share_a_node_in_the_trie(page: Any, url: str, tmp_path: Path) -> None:
    page.goto(url + "/#chat")
    page.locator("#view-chat").wait_for()
    page.fill("#system", SYSTEM)
    page.fill("#max_tokens", "8")
    send(page, "Which rose suits a shady wall?")
    page.click("#new-chat")
    second = send(page, "How often should I water ferns?")
    cached = int(second.locator(".stats").get_attribute("data-cached"))
    assert cached > 0  # the system prompt came from the cache
    screenshot(page, tmp_path, "chat-shared-prefix")

    recent = httpx.get(url + "/admin/state").json()["models"][0]["recent"]
    a, b = (r["id"] for r in recent[-2:])  # the server's numbers for the two requests
    assert recent[-1]["cached_tokens"] == cached

    page.goto(url + "/#trie")
    newest = page.locator(f'#trie-requests .request[data-id="{b}"]')
    assert f"cached {cached}" in newest.inner_text()  # waits for it to show
    # the blocks both requests passed through hold the tokens the second one reused
    page.wait_for_function(
        """([a, b, cached]) => {
            const both = document.querySelectorAll(
                `.ice-label[data-requests~="${a}"][data-requests~="${b}"]`);
            const tokens = [...both].reduce((sum, el) => sum + Number(el.dataset.tokens), 0);
            return both.length > 0 && tokens === cached;
        }""",
        arg=[a, b, cached],
    )
    shared = page.locator(f'.ice-label[data-requests~="{a}"][data-requests~="{b}"]')
    newest.click()
    page.locator(".ice-label.reused").first.wait_for()
    assert page.locator(".ice-label.reused").count() == shared.count()
    shared.first.click()
    page.locator("#trie-detail dl").wait_for()
    assert "garden centre" in page.locator("#trie-detail pre.text").inner_text()
    screenshot(page, tmp_path, "trie")


def test_the_batch_view_shows_two_running_streams(page: Any, url: str, tmp_path: Path) -> None:
    page.goto(url + "/#engine")
    page.locator(".model-card").wait_for()
    messages = [{"role": "user", "content": f"Tell a long story about {topic}."} for topic in "AB"]
    chats = [LongChat(url, MODEL, [m], 60000) for m in messages]
    for chat in chats:
        chat.start()
    try:
        page.wait_for_function(
            "() => document.querySelectorAll('#view-engine tr.row[data-phase=decode]').length === 2"
        )
        screenshot(page, tmp_path, "engine")
    finally:
        for chat in chats:
            chat.end()
    assert all(chat.status == 200 for chat in chats)
    page.wait_for_function("() => !document.querySelector('#view-engine tr.row')")


# -- tools, by hand --------------------------------------------------------------------------


class ToolScript:
    """Stands in for the model: calls get_weather, and answers once the result is in."""

    CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ANSWER = "It is **sunny** in Oslo."

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def run(self, handle: Any) -> Finished:
        prompt = handle.request.prompt_tokens
        answered = "<tool_response>" in self.tokenizer.decode(prompt, skip_special_tokens=False)
        handle.emit(TextDelta(self.ANSWER if answered else self.CALL, (0,)))
        return Finished(FinishReason.STOP, GenerationStats(len(prompt), 1))


@pytest.fixture(scope="module")
def tool_url(tiny_qwen3_dir: Path) -> Iterator[str]:
    def served() -> Any:
        model = build_served(tiny_qwen3_dir, model_id=MODEL)
        engine = Engine(ToolScript(model.loaded.tokenizer))
        return dataclasses.replace(model, engine=engine, runner=None)

    with live_server(served) as base:
        yield base


TOOLS = (
    '[{"name": "get_weather", "description": "The weather in a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]'
)


def test_a_tool_call_is_answered_by_hand_then_edited(
    page: Any, tool_url: str, tmp_path: Path
) -> None:
    page.goto(tool_url + "/#chat")
    page.fill("#tools", TOOLS)
    send(page, "What is the weather in Oslo?")
    call = page.locator(".tool-call")
    assert "get_weather" in call.locator(".who").text_content()
    assert '"city": "Oslo"' in call.locator("pre").inner_text()
    call.locator("textarea").fill('{"sky": "clear", "celsius": 21}')
    call.locator("button", has_text="Send result").click()
    page.locator(".msg.assistant strong", has_text="sunny").wait_for()  # markdown rendered
    assert page.locator(".msg.tool pre").inner_text() == '{"sky": "clear", "celsius": 21}'
    screenshot(page, tmp_path, "chat-tools")
    # edit the question and send it again: the conversation restarts from there
    page.locator(".msg.user button", has_text="Edit").click()
    page.locator(".msg.user textarea").fill("And in Bergen?")
    page.locator(".msg.user button", has_text="Resend").click()
    page.locator(".msg.assistant .stats").first.wait_for()
    page.wait_for_function("() => document.querySelectorAll('.msg').length === 2")
    assert page.locator(".msg.user .text").inner_text() == "And in Bergen?"
    assert page.locator(".tool-call").count() == 1
