"""Qwen3.5 with vision, dense or MoE (transformers' Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration): the hybrid text model (qwen3_5.py, which reads from
the model type whether its MLPs are experts), the vision tower (qwen3_vision.py) and
multimodal RoPE. The two share the tower, the image tokens and the positions; only the
text model inside differs.

Images: the chat template writes <|vision_start|><|image_pad|><|vision_end|> for each;
the processor repeats <|image_pad|> once per token of the image (its rows x cols merged
blocks of patches), and those positions' embeddings become the tower's tokens. Attention
stays causal, inside images too.

Multimodal RoPE, interleaved: of each attention head's rotated pairs, pair j turns with
the row position when j % 3 == 1 and j < 3 * sections[1], with the column position when
j % 3 == 2 and j < 3 * sections[2], and with the temporal one otherwise. A text token has
one position in all three (so plain RoPE serves it); an image whose first token comes at
text position s puts its token (r, c) at (s, s + r, s + c), and the text after it goes on
at s + max(rows, cols). So each image moves the positions of everything after it by
max(rows, cols) - rows * cols: a token's rotary position is its offset plus the sum over
the images before it (`rope_shift`). The caches count offsets; prefill chunks get their
positions from the prompt's images (`forward_placed`), and decode steps rotate at offset +
shift, each row of a batch by its own (`forward_shifted`).

Checkpoint layouts read: transformers' (`model.visual.*`, `model.language_model.*`),
older (`visual.*`), and MLX converters' (`vision_tower.*`, `language_model.model.*`, the
patch convolution's weight channels-last). The MoE's experts come per expert, fused
(`experts.gate_up_proj`, Qwen's published checkpoints) or stacked (`switch_mlp.*`, MLX
converters'); the text model's sanitize reads all three.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from runtime.cache import Cache
from runtime.models import qwen3_5
from runtime.models.decoder import LayerStack
from runtime.models.qwen3_vision import VisionArgs, VisionTower, patchify
from runtime.models.rope import Positions, default_inv_freq
from runtime.types import PromptImage
from runtime.vision import GridResize, ImageLayout
from runtime.vision.spans import GridVision

_VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")
# Qwen3_5Config's defaults
_IMAGE, _VISION_START, _VISION_END = 248_056, 248_053, 248_054
_SECTIONS = (11, 11, 10)  # transformers' default mrope_section


def _mrope_section(text: Mapping[str, Any]) -> tuple[int, int, int]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    given = params.get("mrope_section") if isinstance(params, Mapping) else None
    if not given:
        return _SECTIONS
    sections = [int(s) for s in given]
    if len(sections) != 3:
        raise ValueError(f"mrope_section {given!r}: expected three sections (t, h, w)")
    return sections[0], sections[1], sections[2]


@dataclass(frozen=True)
class ModelArgs(qwen3_5.ModelArgs):
    vision: VisionArgs = field(default_factory=VisionArgs)
    image_token_id: int = _IMAGE
    vision_start_token_id: int = _VISION_START
    vision_end_token_id: int = _VISION_END
    mrope_section: tuple[int, int, int] = _SECTIONS

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ValueError("a qwen3_5 model with vision needs a vision_config")
        text = super().from_config(config)
        assert isinstance(text, ModelArgs)
        if text.rope.rope_type != "default":
            raise ValueError(
                f"multimodal RoPE with rope type {text.rope.rope_type!r} is unsupported"
            )
        nested = config.get("text_config")
        return replace(
            text,
            vision=VisionArgs.from_config(vision),
            image_token_id=int(config.get("image_token_id", _IMAGE)),
            vision_start_token_id=int(config.get("vision_start_token_id", _VISION_START)),
            vision_end_token_id=int(config.get("vision_end_token_id", _VISION_END)),
            mrope_section=_mrope_section(nested if isinstance(nested, Mapping) else config),
        )


def _components(pairs: int, sections: tuple[int, int, int]) -> np.ndarray[Any, Any]:
    """Which position (0 temporal, 1 row, 2 column) each rotated pair turns with."""
    j = np.arange(pairs)
    out = np.zeros(pairs, dtype=np.int64)
    out[(j % 3 == 1) & (j < 3 * sections[1])] = 1
    out[(j % 3 == 2) & (j < 3 * sections[2])] = 2
    return out


class Model(qwen3_5.Model, GridVision):
    args: ModelArgs

    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        v = args.vision
        self.visual = VisionTower(v)
        self._layout = ImageLayout(image_token_id=args.image_token_id, tokens_per_image=0)
        self._grid = GridResize(v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        self._inv_freq = default_inv_freq(args.rope.theta, args.rotary_dim).astype(np.float32)
        self._pairs = _components(args.rotary_dim // 2, args.mrope_section)

    # -- the VisionModel protocol --

    @property
    def image_layout(self) -> ImageLayout:
        return self._layout

    @property
    def image_size(self) -> int:
        return 0  # each image keeps about its own size (image_grid)

    @property
    def image_grid(self) -> GridResize:
        return self._grid

    def image_tokens(self, shape: Sequence[int]) -> int:
        if len(shape) != 3 or shape[0] != self.args.vision.in_channels:
            raise ValueError(f"pixels of shape {tuple(shape)}; expected (3, height, width)")
        return self._grid.tokens(shape)

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, 3, H, W) pixel values (one size) -> (N, tokens per image, hidden)."""
        p = self.args.vision.patch_size
        grid = (pixels.shape[2] // p, pixels.shape[3] // p)
        return self.visual(patchify(pixels, self.args.vision), grid)

    def forward_images(
        self,
        tokens: mx.array,
        caches: Sequence[Cache],
        images: Sequence[tuple[int, mx.array]],
        positions: Positions | None = None,
    ) -> mx.array:
        """`forward` over a (1, L) chunk whose positions from each `start` on hold image
        `features` ((n, hidden), in order, not overlapping), rotated at `positions`."""
        body = self.model
        assert isinstance(body, LayerStack)
        placeholder = tokens == self._layout.image_token_id
        h = body.embed_tokens(mx.where(placeholder, mx.zeros_like(tokens), tokens))
        pieces, at = [], 0
        for start, features in images:
            if features.shape[-1] != h.shape[-1]:
                raise ValueError(
                    f"image features of width {features.shape[-1]} for a text model of "
                    f"{h.shape[-1]}: the vision config's out_hidden_size is wrong"
                )
            pieces += [h[:, at:start], features[None].astype(h.dtype)]
            at = start + features.shape[0]
        pieces.append(h[:, at:])
        return self._run(mx.concatenate(pieces, axis=1), caches, positions)

    # -- multimodal RoPE (runtime.vision.spans.GridVision) --

    def rope_shift(self, images: Sequence[PromptImage]) -> int:
        """How far the rotary position of a token after all `images` is from its offset."""
        shift = 0
        for image in images:
            rows, cols = self._grid.grid(image.shape)
            shift += max(rows, cols) - rows * cols
        return shift

    def forward_placed(
        self,
        tokens: mx.array,
        caches: Sequence[Cache],
        images: Sequence[tuple[int, mx.array]],
        placed: Sequence[PromptImage],
        offset: int,
    ) -> mx.array:
        """`forward_images` over the chunk at `offset` of a prompt whose images are
        `placed`: its positions from their grids."""
        return self.forward_images(
            tokens, caches, images, self._positions(placed, offset, tokens.shape[1])
        )

    def forward_shifted(
        self, tokens: mx.array, caches: Sequence[Cache], shift: int | mx.array
    ) -> mx.array:
        """`forward` with every row's rotary positions moved by `shift` (one per row)."""
        body = self.model
        assert isinstance(body, LayerStack)
        return self._run(body.embed_tokens(tokens), caches, Positions(shift=shift))

    def _positions(self, placed: Sequence[PromptImage], offset: int, length: int) -> Positions:
        """The rotary positions of the chunk [offset, offset + length): a shift when it
        holds no image token, else every token's (t, h, w) turned into angles."""
        index = np.arange(offset, offset + length)
        thw = np.stack([index, index, index])
        shift, inside = 0, False  # shift: what the images before the current one add
        for image in sorted(placed, key=lambda i: i.start):
            rows, cols = self._grid.grid(image.shape)
            within = (index >= image.start) & (index < image.end)
            if within.any():
                inside = True
                first = image.start + shift
                r = index[within] - image.start
                thw[:, within] = first + np.stack([0 * r, r // cols, r % cols])
            delta = max(rows, cols) - rows * cols
            thw[:, index >= image.end] += delta
            shift += delta
        if not inside:
            return Positions(shift=int(thw[0, 0]) - offset)
        angles = thw[self._pairs].T.astype(np.float32) * self._inv_freq  # (L, pairs)
        a = mx.array(angles)
        return Positions(cos=mx.cos(a), sin=mx.sin(a))

    def _run(self, h: mx.array, caches: Sequence[Cache], positions: Positions | None) -> mx.array:
        body = self.model
        assert isinstance(body, LayerStack)
        for layer, cache in zip(body.layers, caches, strict=True):
            h = layer(h, cache, positions)
        out: mx.array = body.norm(h)
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text: dict[str, mx.array] = {}
        tower: dict[str, mx.array] = {}
        for name, value in weights.items():
            prefix = next((p for p in _VISION_PREFIXES if name.startswith(p)), None)
            if prefix is None:
                text[name] = value
            else:
                tower[name[len(prefix) :]] = value
        out = super().sanitize(text)
        out.update({f"visual.{k}": v for k, v in self.visual.sanitize(tower).items()})
        return out
