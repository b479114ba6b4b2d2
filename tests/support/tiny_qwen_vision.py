"""Tiny random Qwen3.5 vision models, dense and MoE, from transformers (the oracle for
runtime/models/qwen3_5_vision.py), saved as servable folders (a word-level tokenizer with
Qwen's chat and image tokens, a preprocessor config), and prompts with images for them.

Both kinds share the vision tower and the multimodal RoPE; they differ in the text model
only, so every helper here serves either.

Import only after ``pytest.importorskip("torch")`` and ``("transformers")``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import torch
import transformers

from runtime.models import qwen3_5_vision
from runtime.models.qwen3_vision import patchify
from runtime.types import PromptImage
from runtime.vision.preprocess import digest
from runtime.vision.spans import PromptImages, grid_of
from tests.support.tiny_hybrid import _MOE, _TEXT, _VISION, VOCAB, _randomize
from tests.support.tiny_models import load_mlx, save_tiny

START, END, IMAGE = 998, 999, 1000  # inside the tiny vocabulary
PATCH, MERGE = 4, 2  # an image token covers 8 x 8 pixels
SPECIAL = {
    990: "<|im_start|>",
    991: "<|im_end|>",
    992: "<think>",
    993: "</think>",
    997: "<|video_pad|>",
    START: "<|vision_start|>",
    END: "<|vision_end|>",
    IMAGE: "<|image_pad|>",
}
EOS = 991
# rotary on 16 of 32 dims (8 pairs): t, h and w sections all present, interleaved
TEXT_CONFIG: dict[str, Any] = {
    **_TEXT,
    "head_dim": 32,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
}
# a 4 x 4 learned position grid, interpolated to every image's grid of patches
VISION_CONFIG: dict[str, Any] = {
    **_VISION,
    "depth": 2,
    "patch_size": PATCH,
    "num_position_embeddings": 16,
}
_TOKENS: dict[str, Any] = {
    "image_token_id": IMAGE,
    "vision_start_token_id": START,
    "vision_end_token_id": END,
    "video_token_id": 997,
}


def _dense() -> Any:
    config = transformers.Qwen3_5Config(
        text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, **_TOKENS
    )
    return transformers.Qwen3_5ForConditionalGeneration(config)


def _moe() -> Any:
    """Every layer MoE (4 experts, top 2, a gated shared expert): the multimodal
    checkpoint nests the MoE text model under ``model.language_model.``."""
    config = transformers.Qwen3_5MoeConfig(
        text_config={**TEXT_CONFIG, **_MOE}, vision_config=VISION_CONFIG, **_TOKENS
    )
    return transformers.Qwen3_5MoeForConditionalGeneration(config)


DENSE, MOE = "qwen3_5", "qwen3_5_moe"
# model_type -> builder of the transformers model
KINDS: Mapping[str, Callable[[], Any]] = {DENSE: _dense, MOE: _moe}


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer ("w<i>" is token i) whose chat and image tokens carry
    Qwen's names, as special tokens."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL.values()])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_preprocessor_config(
    folder: Path, low: int = 256, high: int = 4096, patch: int = PATCH
) -> None:
    config = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "patch_size": patch,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": low, "longest_edge": high},
    }
    (folder / "preprocessor_config.json").write_text(json.dumps(config))


def make(kind: str, directory: Path) -> Any:
    """Build the `kind` model (a key of KINDS), save it with its tokenizer and
    preprocessor config into `directory`; return the torch model (eval)."""
    model = save_tiny((KINDS[kind], None), directory, 0, _randomize)
    write_tokenizer(directory)
    write_preprocessor_config(directory)
    return model


def vision_model(tiny: Mapping[str, tuple[Any, Path]], kind: str = DENSE) -> tuple[Any, Any]:
    """transformers' model of `kind` from `tiny` (tests.support.model_checks.TinyModels over
    `make`) and ours loaded from its folder: the vision model, its text model dense or MoE
    as the kind says."""
    hf, directory = tiny[kind]
    model = load_mlx(directory)
    assert isinstance(model, qwen3_5_vision.Model) and grid_of(model) is model
    assert model.args.model_type == kind and (model.args.num_experts > 0) == (kind == MOE)
    return hf, model


def pixels(seed: int, height: int, width: int) -> np.ndarray[Any, Any]:
    """Normalised pixel values of one image, (3, height, width)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((3, height, width)).astype(np.float32)


def tokens_of(picture: np.ndarray[Any, Any]) -> int:
    return (picture.shape[1] // (PATCH * MERGE)) * (picture.shape[2] // (PATCH * MERGE))


def prompt(
    pictures: Sequence[np.ndarray[Any, Any]], texts: Sequence[Sequence[int]]
) -> tuple[list[int], list[PromptImage]]:
    """texts[0] <image> texts[1] <image> ... texts[-1], each image wrapped in
    <|vision_start|> ... <|vision_end|> as the chat template writes it."""
    tokens, images = list(texts[0]), []
    for picture, text in zip(pictures, texts[1:], strict=True):
        tokens.append(START)
        n = tokens_of(picture)
        images.append(
            PromptImage(picture.tobytes(), picture.shape, digest(picture), len(tokens), n)
        )
        tokens += [IMAGE] * n + [END, *text]
    return tokens, images


def hf_inputs(
    tokens: Sequence[int], pictures: Sequence[np.ndarray[Any, Any]], model: Any
) -> dict[str, Any]:
    """transformers' inputs: the processor's pixel_values are our patches (checked
    against the processor in the preprocessing tests)."""
    patches = [np.array(patchify(mx.array(p[None]), model.args.vision))[0] for p in pictures]
    grid = [[1, p.shape[1] // PATCH, p.shape[2] // PATCH] for p in pictures]
    ids = torch.tensor([list(tokens)])
    return {
        "input_ids": ids,
        "pixel_values": torch.from_numpy(np.concatenate(patches)),
        "image_grid_thw": torch.tensor(grid),
        "mm_token_type_ids": (ids == IMAGE).long(),
    }


def prefill(
    model: Any, images: PromptImages, tokens: Sequence[int], chunk: int, caches: Any = None
) -> tuple[np.ndarray[Any, Any], list[int]]:
    """All logits of `tokens` prefilled in chunks of about `chunk` (into `caches`, or
    fresh ones); the chunks' ends."""
    caches = model.make_caches() if caches is None else caches
    outs, ends, offset = [], [], 0
    while offset < len(tokens):
        n = images.chunk(offset, min(chunk, len(tokens) - offset))
        hidden = images.forward(tokens[offset : offset + n], caches, offset)
        outs.append(np.array(model.logits(hidden)))
        offset += n
        ends.append(offset)
    return np.concatenate(outs, axis=1), ends
