"""Our tokenizer: a ``tokenizers.Tokenizer`` plus the special-token facts the engine needs.

BOS is added by this wrapper (``add_bos``), never by the wrapped tokenizer's post-processor,
so a rendered chat prompt that already starts with the BOS text does not get a second one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from runtime.text.plain import PlainEncoder, encode_with_plain_spans

log = logging.getLogger(__name__)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def token_ids(value: Any) -> list[int]:
    """A token-id field of a model's JSON config (eos_token_id in config.json or
    generation_config.json): an int, a list of ints, or absent."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class Tokenizer:
    """Encode/decode with a model's special-token conventions (see module docstring).

    Built from a HF-style folder here (``from_folder``), from a GGUF by the loader
    (runtime.load.gguf.tokenizer), or directly from a ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        hf: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos: bool = False,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.hf = hf
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = hf.token_to_id(bos_token) if bos_token else None
        self.add_bos = bool(add_bos and self.bos_token_id is not None)
        eos = set(extra_eos_ids)
        eos_id = hf.token_to_id(eos_token) if eos_token else None
        if eos_id is not None:
            eos.add(eos_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        added = hf.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, tok in added.items() if tok.special)
        self.added_ids: frozenset[int] = frozenset(added)
        # the added tokens' text: all of them, and those marked special (control tokens)
        self.added_tokens: frozenset[str] = frozenset(tok.content for tok in added.values())
        self.special_tokens: frozenset[str] = frozenset(
            tok.content for tok in added.values() if tok.special
        )
        self._plain = PlainEncoder(hf)

    # -- constructors -----------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ special_tokens_map.json and
        generation_config.json for BOS/EOS) from a HF-style model folder."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        hf = HFTokenizer.from_file(str(file))
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")
        bos = _token_text(config.get("bos_token")) or _token_text(special_map.get("bos_token"))
        eos = _token_text(config.get("eos_token")) or _token_text(special_map.get("eos_token"))
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds(hf, bos)
        return cls(
            hf,
            bos_token=bos,
            eos_token=eos,
            add_bos=bool(add_bos),
            extra_eos_ids=token_ids(generation.get("eos_token_id")),
        )

    # -- the API ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; special tokens written in the text are matched whole either way,
        ``add_special_tokens`` only decides the leading BOS."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def encode_prompt(self, text: str, *, content: Sequence[tuple[int, int]] = ()) -> list[int]:
        """A rendered chat prompt: BOS only if the model wants one and the template did
        not already write it. `content`: character spans that came from message content;
        an added token that meets one is read as plain text (see runtime.text.plain)."""
        wants_bos = self.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        if not content:
            return self.encode(text, add_special_tokens=wants_bos)
        ids = encode_with_plain_spans(self.hf, self._plain, self.added_ids, text, content)
        if wants_bos and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, i: int) -> str | None:
        token = self.hf.id_to_token(i)
        return None if token is None else str(token)

    def token_to_id(self, token: str) -> int | None:
        value = self.hf.token_to_id(token)
        return None if value is None else int(value)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
            f"eos={self.eos_token!r}, add_bos={self.add_bos})"
        )


def _post_processor_adds(hf: HFTokenizer, bos: str | None) -> bool:
    """Whether the tokenizer.json post-processor prepends BOS (Llama 3 has no
    add_bos_token flag and relies on it)."""
    if not bos:
        return False
    bos_id = hf.token_to_id(bos)
    if bos_id is None:
        return False
    with_special = hf.encode("a", add_special_tokens=True).ids
    return bool(with_special) and with_special[0] == bos_id


def read_chat_template(folder: str | Path) -> str | None:
    """The chat template of a HF-style folder: chat_template.jinja, else
    tokenizer_config.json's "chat_template" (a string, or a list of named templates of
    which "default" is taken)."""
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    value = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if value is None:
        value = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            str(t.get("name")): str(t.get("template"))
            for t in value
            if isinstance(t, Mapping) and t.get("template")
        }
        if "default" in named:
            return named["default"]
        if named:
            return next(iter(named.values()))
    return None
