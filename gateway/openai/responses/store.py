"""What /v1/responses keeps between requests: stored responses (for GET, DELETE and
`previous_response_id`) and the key that seals reasoning handed to clients.

The store is in memory, bounded by count and by bytes (the JSON size of what it
holds), least-recently-used out first. A response keeps only its own items (its
input, then its output as input items) and a link to the response it continued;
a conversation is rebuilt by walking the links, so a long chain costs memory in
proportion to its length, not its square. Reading a chain refreshes every response
in it, the oldest last: the least recently used is then a leaf, whose eviction
leaves every other conversation in the store whole.

Everything here runs on the event loop (no locks needed); it is created lazily per
app by `responses_state`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette

from gateway.core.errors import NotFound

log = logging.getLogger(__name__)

MAX_RESPONSES = 1024
MAX_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Stored:
    id: str
    body: dict[str, Any]  # the response object, as GET returns it
    items: tuple[dict[str, Any], ...]  # this turn's input items, then its output items
    previous: str | None  # the response this one continued
    size: int = 0  # bytes counted against the store's budget


def _size(body: dict[str, Any], items: Sequence[dict[str, Any]]) -> int:
    return len(json.dumps(body, ensure_ascii=False)) + sum(
        len(json.dumps(item, ensure_ascii=False)) for item in items
    )


@dataclass
class ResponseStore:
    max_responses: int = MAX_RESPONSES
    max_bytes: int = MAX_BYTES
    _entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    _items: dict[str, str] = field(default_factory=dict)  # item id -> response id
    bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        body: dict[str, Any],
        items: Sequence[dict[str, Any]],
        previous: str | None,
    ) -> None:
        size = _size(body, items)
        if size > self.max_bytes:
            log.warning(
                "response %s not stored: %d bytes is more than the store holds (%d)",
                body["id"],
                size,
                self.max_bytes,
            )
            return
        self.delete(body["id"])
        entry = Stored(body["id"], body, tuple(items), previous, size)
        self._entries[entry.id] = entry
        self.bytes += size
        for item in entry.items:
            if isinstance(item.get("id"), str):
                self._items[item["id"]] = entry.id
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            log.info("response store full: evicting %s", oldest)
            self.delete(oldest)

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        for item in entry.items:
            if self._items.get(item.get("id", "")) == response_id:
                del self._items[item["id"]]
        return True

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the conversation `response_id` ends, oldest first."""
        chain: list[Stored] = []
        at: str | None = response_id
        seen: set[str] = set()
        while at is not None and at not in seen:
            seen.add(at)
            entry = self.get(at)
            if entry is None:
                if at == response_id:
                    raise NotFound(
                        f"No stored response with id {response_id!r}: it was never stored "
                        "(store: false), was deleted, or was evicted from this server's "
                        "in-memory store (or the server restarted). Send the whole "
                        "conversation as input instead.",
                        param="previous_response_id",
                    )
                raise NotFound(
                    f"The conversation of previous_response_id {response_id!r} cannot be "
                    f"rebuilt: an earlier response in it ({at!r}) is no longer stored. "
                    "Send the whole conversation as input instead.",
                    param="previous_response_id",
                )
            chain.append(entry)
            at = entry.previous
        return [item for entry in reversed(chain) for item in entry.items]

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An input or output item of a stored response, by its id."""
        owner = self._items.get(item_id)
        entry = self._entries.get(owner) if owner is not None else None
        if entry is None:
            return None
        return next((i for i in entry.items if i.get("id") == item_id), None)


class ReasoningSeal:
    """`encrypted_content` for reasoning items: the reasoning text with an HMAC under a
    key this server draws at start, so the text a client sends back can be trusted to
    be what this server's model wrote. It is signed, not encrypted: the client already
    saw the text in the reasoning item's content."""

    VERSION = 1

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode("utf-8"), hashlib.sha256).hexdigest()

    def seal(self, text: str) -> str:
        payload = {"v": self.VERSION, "text": text, "mac": self._mac(text)}
        raw = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return base64.b64encode(raw.encode("utf-8")).decode("ascii")

    def open(self, sealed: str) -> str | None:
        """The reasoning text, or None (logged) for content this server did not seal:
        another server's (Codex may replay OpenAI's), an older run's, or a tampered one."""
        try:
            payload = json.loads(base64.b64decode(sealed, validate=True))
        except (binascii.Error, ValueError):
            log.info("ignoring reasoning encrypted_content that this server did not write")
            return None
        text = payload.get("text") if isinstance(payload, dict) else None
        mac = payload.get("mac") if isinstance(payload, dict) else None
        if not isinstance(text, str) or not isinstance(mac, str):
            log.info("ignoring reasoning encrypted_content that this server did not write")
            return None
        if not hmac.compare_digest(mac, self._mac(text)):
            log.info("ignoring reasoning encrypted_content with a bad signature")
            return None
        return text


@dataclass
class ResponsesState:
    store: ResponseStore = field(default_factory=ResponseStore)
    seal: ReasoningSeal = field(default_factory=ReasoningSeal)


def responses_state(app: Starlette) -> ResponsesState:
    """The app's Responses state, made on first use (one per app, so each server and
    each test server has its own store and key)."""
    state = getattr(app.state, "responses", None)
    if not isinstance(state, ResponsesState):
        state = ResponsesState()
        app.state.responses = state
    return state
