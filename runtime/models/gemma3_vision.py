"""Gemma 3 with vision (transformers' Gemma3ForConditionalGeneration): the text model, a
SigLIP vision tower (siglip.py) and the multi-modal projector.

An image's patches (896 / 14 = 64 per side) are average-pooled to `mm_tokens_per_image`
(256 = 16 x 16) tokens, RMS-normalised (gemma's 1 + weight) and projected to the text
model's width. Those features replace the embeddings of the prompt's image tokens (the
other tokens keep their scaled embeddings), and the positions of one image attend to each
other both ways (gemma3.open_image_spans).

Checkpoint layouts read: the hub's (`language_model.model.*`,
`vision_tower.vision_model.*`, `multi_modal_projector.*`), transformers 4's
(`model.language_model.*`, `model.vision_tower.vision_model.*`, ...), transformers 5's
saved one (`vision_tower.*` without `vision_model.`), and MLX converters' (the patch
convolution's weight channels-last).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from runtime.cache import Cache
from runtime.models import gemma3
from runtime.models.base import RMSNorm, config_int
from runtime.models.siglip import VisionArgs, VisionTower
from runtime.vision import ImageLayout
from runtime.vision.spans import VisionModel

# checkpoint prefix -> our module's, tried in order
_VISION_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
# Gemma3Config's defaults
_TOKENS_PER_IMAGE = 256
_BOI, _EOI, _IMAGE = 255_999, 256_000, 262_144
_WRAP = "\n\n"  # Gemma3Processor puts a blank line either side of an image


@dataclass(frozen=True)
class ModelArgs(gemma3.ModelArgs):
    vision: VisionArgs = field(default_factory=VisionArgs)
    mm_tokens_per_image: int = _TOKENS_PER_IMAGE
    image_token_id: int = _IMAGE
    boi_token_id: int = _BOI
    eoi_token_id: int = _EOI

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        vision = config.get("vision_config")
        if not isinstance(vision, Mapping):
            raise ValueError("a gemma3 model with vision needs a vision_config")

        def token(key: str, alias: str, default: int) -> int:
            return config_int(config, key, config_int(config, alias, default))

        text = super().from_config(config)
        assert isinstance(text, ModelArgs)
        return replace(
            text,
            vision=VisionArgs.from_config(vision),
            mm_tokens_per_image=config_int(config, "mm_tokens_per_image", _TOKENS_PER_IMAGE),
            image_token_id=token("image_token_index", "image_token_id", _IMAGE),
            boi_token_id=token("boi_token_index", "boi_token_id", _BOI),
            eoi_token_id=token("eoi_token_index", "eoi_token_id", _EOI),
        )


class MultiModalProjector(Module):
    """Patches -> `tokens` pooled, normalised, projected tokens in the text model's width."""

    def __init__(self, vision: VisionArgs, text_hidden: int, tokens: int) -> None:
        super().__init__()
        side = math.isqrt(tokens)
        patches = vision.patches_per_side
        if side * side != tokens or side < 1 or patches % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens} must be a square whose side divides the "
                f"{patches} patches per side of a {vision.image_size}-pixel image"
            )
        self._side, self._kernel = side, patches // side
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, text_hidden))
        self.mm_soft_emb_norm = RMSNorm(vision.hidden_size, vision.layer_norm_eps, unit_offset=True)

    def __call__(self, patches: mx.array) -> mx.array:
        n, _, dims = patches.shape
        side, k = self._side, self._kernel
        pooled = patches.reshape(n, side, k, side, k, dims).mean(axis=(2, 4))
        normed = self.mm_soft_emb_norm(pooled.reshape(n, side * side, dims))
        return (normed @ self.mm_input_projection_weight).astype(patches.dtype)


def _vision_name(name: str) -> str | None:
    for prefix, ours in _VISION_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix) :]
    return None


class Model(gemma3.Model, VisionModel):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__(args)
        self.vision_tower = VisionTower(args.vision)
        self.multi_modal_projector = MultiModalProjector(
            args.vision, args.hidden_size, args.mm_tokens_per_image
        )
        self._layout = ImageLayout(
            image_token_id=args.image_token_id,
            tokens_per_image=args.mm_tokens_per_image,
            start_id=args.boi_token_id,
            end_id=args.eoi_token_id,
            wrap=_WRAP,
        )

    @property
    def image_layout(self) -> ImageLayout:
        return self._layout

    @property
    def image_size(self) -> int:
        return int(self.args.vision.image_size)

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, 3, size, size) pixel values -> (N, tokens per image, hidden) features."""
        return self.multi_modal_projector(self.vision_tower(pixels))

    def forward_images(
        self,
        tokens: mx.array,
        caches: Sequence[Cache],
        images: Sequence[tuple[int, mx.array]],
    ) -> mx.array:
        """`forward` over a (1, L) chunk whose positions from each `start` on hold image
        `features` ((n, hidden), in order, not overlapping) instead of token embeddings."""
        body = self.model
        assert isinstance(body, gemma3.TextModel)
        placeholder = tokens == self._layout.image_token_id
        # the image token may lie outside the embedding table: look up token 0 there
        h = body.embed(mx.where(placeholder, mx.zeros_like(tokens), tokens))
        pieces, at, spans = [], 0, []
        for start, features in images:
            end = start + features.shape[0]
            pieces += [h[:, at:start], features[None].astype(h.dtype)]
            spans.append((start, end))
            at = end
        pieces.append(h[:, at:])
        out: mx.array = body.run(mx.concatenate(pieces, axis=1), caches, spans)
        return out

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text: dict[str, mx.array] = {}
        tower: dict[str, mx.array] = {}
        projector: dict[str, mx.array] = {}
        for name, value in weights.items():
            ours = _vision_name(name)
            if ours is None:
                text[name] = value
            elif ours.startswith("vision_tower."):
                tower[ours[len("vision_tower.") :]] = value
            else:
                projector[ours] = value
        out = super().sanitize(text)
        out.update({f"vision_tower.{k}": v for k, v in self.vision_tower.sanitize(tower).items()})
        out.update(projector)
        return out
