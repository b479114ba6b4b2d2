"""What the soak's clients say: repeated prompts (so the prefix cache hits, in memory and
from disk), fresh ones (so it misses and evicts), long documents of a few thousand
tokens (prefill in chunks, snapshots of tens of MB), and the tools and JSON schemas of
the tool-call and structured-output requests. All of it from seeded generators: a run
with the same seed sends the same texts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_VOCABULARY = (
    "harbour tide ship crane rope storm dock keeper lantern anchor cargo pier wave gull "
    "north south east west morning evening night river bridge market bread salt fish "
    "net boat sail mast deck captain sailor chart compass weather wind rain fog sun "
    "cloud island reef shore sand stone tower bell clock road cart horse village town "
    "city letter message ledger record price coin trade merchant barrel grain wool iron "
    "timber copper lamp oil candle window door roof wall garden field orchard apple pear "
    "plum cherry winter spring summer autumn journey visit return arrive depart wait "
    "count measure repair paint build carry lift pull push open close watch listen "
    "quiet loud early late slow quick heavy light old new small large long short warm "
    "cold bright dark careful busy empty full"
)
WORDS = tuple(_VOCABULARY.split())

QUESTIONS = (
    "Which ships leave before the evening tide?",
    "How should the mooring ropes be checked after a storm?",
    "List the cranes that are free tomorrow morning.",
    "Who holds the keys to the dry dock?",
    "What did the harbour master write in the ledger yesterday?",
    "When does the next cargo of timber arrive?",
    "Summarize the weather report in one sentence.",
    "Name two things to repair on the north pier.",
)

TOOLS_OPENAI: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_tide",
            "description": "Get the next high tide for a harbour.",
            "parameters": {
                "type": "object",
                "properties": {
                    "harbour": {"type": "string"},
                    "days": {"type": "integer", "minimum": 0, "maximum": 7},
                },
                "required": ["harbour"],
            },
        },
    },
]
TOOLS_ANTHROPIC: list[dict[str, Any]] = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS_OPENAI
]
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS_OPENAI)
TOOL_QUESTIONS = (
    "What is the weather in Lisbon right now?",
    "When is the next high tide in Brest?",
    "Is it raining in Bergen, and when is high tide there?",
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "rain": {"type": "boolean"},
        "ships": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "rain", "ships"],
    "additionalProperties": False,
}


def _text(rng: random.Random, words: int) -> str:
    sentences: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 14))
        left -= n
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        sentences.append(sentence[:1].upper() + sentence[1:] + ".")
    return " ".join(sentences)


@dataclass(frozen=True)
class Prompts:
    """The fixed texts of a run (made from its seed)."""

    systems: tuple[str, ...]  # a few, each shared by many requests
    documents: tuple[str, ...]  # the long ones, a few thousand tokens each

    @classmethod
    def make(cls, seed: int, long_words: int = 2200) -> Prompts:
        rng = random.Random(seed)
        systems = tuple(
            f"You are the assistant of harbour office {i}. " + _text(rng, 120) for i in range(3)
        )
        documents = tuple(_text(rng, long_words) for _ in range(3))
        return cls(systems, documents)

    def repeated(self, rng: random.Random) -> list[dict[str, Any]]:
        """One of a few dozen conversations: each comes back again and again."""
        return [
            {"role": "system", "content": rng.choice(self.systems)},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ]

    def fresh(self, rng: random.Random) -> list[dict[str, Any]]:
        """A conversation never seen before (it shares only the template's opening)."""
        return [{"role": "user", "content": _text(rng, rng.randint(20, 80)) + " Explain."}]

    def messages(self, rng: random.Random) -> list[dict[str, Any]]:
        """Mostly repeated, sometimes fresh, sometimes a follow-up turn."""
        roll = rng.random()
        if roll < 0.55:
            return self.repeated(rng)
        if roll < 0.8:
            return self.fresh(rng)
        first = self.repeated(rng)
        return [
            *first,
            {"role": "assistant", "content": _text(rng, 12)},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ]

    def long(self, rng: random.Random) -> list[dict[str, Any]]:
        """A long document (one of three, so later ones hit) and a question on it."""
        document = rng.choice(self.documents)
        question = rng.choice(QUESTIONS)
        return [{"role": "user", "content": f"Read this log:\n\n{document}\n\n{question}"}]

    def tool_messages(self, rng: random.Random) -> list[dict[str, Any]]:
        return [{"role": "user", "content": rng.choice(TOOL_QUESTIONS)}]


def split_system(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Anthropic's shape: the system prompt beside the messages, not among them."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ("\n".join(system) if system else None), rest
