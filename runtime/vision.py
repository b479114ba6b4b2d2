"""Vision models, and one request's images on the engine's side.

`VisionModel` is the capability: a model that encodes images and runs a prefill chunk
whose image positions hold image features (runtime/models/gemma3_vision.py).

`PromptImages` is what prefill needs of one request's images (runtime.types.PromptImage):

- prefix-cache keys: an image span's positions are keyed by the image's content hash
  (prefix_trie.image_keys), so two different images never share cached state and the same
  image after the same tokens reuses it;
- chunking: a chunk never ends inside a span (the positions of an image attend to each
  other both ways, so they are computed together) and snapshot points inside spans are
  skipped; a chunk may start inside one, when the cache already holds its beginning (the
  cached keys and values of the same image after the same prefix are exact);
- the vision encoder runs once per image of the request (images with the same content
  once between them), when the chunk holding its span is computed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from runtime.images import ImageLayout, Preprocessing, VisionSpec, pixel_array
from runtime.prefix_trie import Key, image_keys
from runtime.types import PromptImage

log = logging.getLogger(__name__)


@runtime_checkable
class VisionModel(Protocol):
    """A language model that reads images (declared by subclassing, not sniffed)."""

    @property
    def image_layout(self) -> ImageLayout: ...

    @property
    def image_size(self) -> int:
        """The square side, in pixels, the vision tower takes."""
        ...

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, 3, size, size) pixel values -> (N, tokens per image, hidden) features."""
        ...

    def forward(self, tokens: mx.array, caches: Sequence[Any] | None = None) -> mx.array: ...

    def forward_images(
        self, tokens: mx.array, caches: Sequence[Any], images: Sequence[tuple[int, mx.array]]
    ) -> mx.array:
        """`forward` over a (1, L) chunk whose positions from each `start` on hold the
        `features` ((n, hidden), in order) instead of their tokens' embeddings."""
        ...


def vision_of(model: object) -> VisionModel | None:
    return model if isinstance(model, VisionModel) else None


def vision_spec(
    model: object, token_text: Callable[[int], str | None], folder: Path | None
) -> VisionSpec | None:
    """The HTTP side's view of a vision model (None for a text model): `token_text` is
    the tokenizer's id -> text, `folder` holds preprocessor_config.json (if any)."""
    vision = vision_of(model)
    if vision is None:
        return None
    prep = Preprocessing.read(folder, vision.image_size)
    try:
        return VisionSpec.build(vision.image_layout, token_text, prep)
    except ValueError as exc:
        log.warning("images cannot be placed in this model's prompts (%s): text only", exc)
        return None


class PromptImages:
    """One request's images during prefill (see the module docstring)."""

    def __init__(
        self, model: VisionModel, images: Sequence[PromptImage], prompt: Sequence[int]
    ) -> None:
        _check(model, images, prompt)
        self._model = model
        self._images = tuple(images)
        self._features: dict[str, mx.array] = {}  # digest -> (tokens, hidden)

    @classmethod
    def of(
        cls, model: object, images: Sequence[PromptImage], prompt: Sequence[int]
    ) -> PromptImages | None:
        """The request's images (None when it has none); ValueError when they cannot be
        read: a model without vision, or spans that do not match the prompt."""
        if not images:
            return None
        vision = vision_of(model)
        if vision is None:
            raise ValueError("this model has no vision: a request with images cannot run")
        return cls(vision, images, prompt)

    def keys(self, tokens: Sequence[int]) -> tuple[Key, ...]:
        """Prefix-cache keys for `tokens` (the prompt, then any generated tokens)."""
        out: list[Key] = list(tokens)
        for image in self._images:
            n = min(image.length, len(out) - image.start)
            if n > 0:
                out[image.start : image.start + n] = image_keys(image.digest, image.length)[:n]
        return tuple(out)

    def marks(self, points: Iterable[int]) -> list[int]:
        """The snapshot points a prefill may pause at: those not inside a span."""
        return [p for p in points if not any(i.start < p < i.end for i in self._images)]

    def chunk(self, offset: int, n: int) -> int:
        """`n`, the length of a chunk starting at `offset`, changed so it does not end
        inside a span: cut before a span it enters, or extended to the end of the span it
        starts in (never past the next pause point outside spans, never past the prompt's
        last token, which no span holds)."""
        end = offset + n
        for image in self._images:
            if image.start < end < image.end:
                end = image.start if image.start > offset else image.end
        return end - offset

    def forward(self, tokens: Sequence[int], caches: Sequence[Any], offset: int) -> mx.array:
        """The model over the chunk `tokens` at `offset`: its images' features in place."""
        x = mx.array(np.asarray(tokens, dtype=np.int32))[None]
        images = self._in_chunk(offset, offset + len(tokens))
        if not images:
            return self._model.forward(x, caches)
        return self._model.forward_images(x, caches, images)

    def _in_chunk(self, start: int, end: int) -> list[tuple[int, mx.array]]:
        inside = [i for i in self._images if i.start < end and i.end > start]
        if any(i.end > end for i in inside):
            raise ValueError("a prefill chunk may not end inside an image (see chunk())")
        self._encode([i for i in inside if i.digest not in self._features])
        out = []
        for image in inside:
            lo = max(image.start, start)
            out.append((lo - start, self._features[image.digest][lo - image.start :]))
        # prefill only moves forward: features no later span needs are let go
        later = {i.digest for i in self._images if i.end > end}
        for digest in [d for d in self._features if d not in later]:
            del self._features[digest]
        return out

    def _encode(self, images: Sequence[PromptImage]) -> None:
        todo = list({i.digest: i for i in images}.values())
        if not todo:
            return
        pixels = mx.array(np.stack([pixel_array(i.pixels, i.shape) for i in todo]))
        features = self._model.encode_images(pixels)
        mx.eval(features)
        for n, image in enumerate(todo):
            self._features[image.digest] = features[n]


def _check(model: VisionModel, images: Sequence[PromptImage], prompt: Sequence[int]) -> None:
    layout = model.image_layout
    size = model.image_size
    previous_end = 0
    for n, image in enumerate(images, 1):
        where = f"image {n} of {len(images)}"
        if image.shape != (3, size, size):
            raise ValueError(
                f"{where}: pixels of shape {image.shape}; expected (3, {size}, {size})"
            )
        if image.length != layout.tokens_per_image:
            raise ValueError(
                f"{where}: a span of {image.length} tokens; this model gives an image "
                f"{layout.tokens_per_image}"
            )
        if image.start < previous_end:
            raise ValueError(f"{where}: spans must be in order and not overlap")
        if image.end >= len(prompt):
            raise ValueError(f"{where}: the prompt must go on after an image's span")
        if any(t != layout.image_token_id for t in prompt[image.start : image.end]):
            raise ValueError(f"{where}: its span does not hold the model's image tokens")
        previous_end = image.end
