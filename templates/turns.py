"""The special tokens that open a message in the chat formats we know. The runtime's
prefix cache gives layers that cannot rewind (recurrent, hybrid models) a restore point
at each message start, where the next request of the same conversation may differ."""

from __future__ import annotations

TURN_OPENERS: tuple[str, ...] = (
    "<|im_start|>",  # ChatML: Qwen, SmolLM, Hermes
    "<|start_header_id|>",  # Llama 3
    "<start_of_turn>",  # Gemma
    "<|system|>",  # GLM-4.x
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<｜User｜>",  # DeepSeek V3
    "<｜Assistant｜>",
    "<｜tool▁outputs▁begin｜>",
)
