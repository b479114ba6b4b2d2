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

`GridVision` models (Qwen3.5) take each image at about its own size and place its
tokens on its grid of patches (multimodal RoPE): their attention stays causal, so chunks
may cut an image, and the text after an image sits at a rotary position other than its
offset. Prefill chunks get their positions from the prompt's images; decode steps from
`PromptImages.shift` (`decode_forward`). Both depend only on the prompt, so state the
prefix cache restores (keyed by the same image hashes) is continued exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from runtime.prefix import Key, image_keys
from runtime.types import PromptImage
from runtime.vision.preprocess import (
    GridResize,
    ImageLayout,
    Preprocessing,
    VisionSpec,
    pixel_array,
)

log = logging.getLogger(__name__)


@runtime_checkable
class VisionModel(Protocol):
    """A language model that reads images (declared by subclassing, not sniffed)."""

    @property
    def image_layout(self) -> ImageLayout: ...

    @property
    def image_size(self) -> int:
        """The square side, in pixels, the vision tower takes (0 for a GridVision)."""
        ...

    def encode_images(self, pixels: mx.array) -> mx.array:
        """(N, 3, size, size) pixel values -> (N, tokens per image, hidden) features
        (a GridVision: N images of one size)."""
        ...

    def forward(self, tokens: mx.array, caches: Sequence[Any] | None = None) -> mx.array: ...

    def forward_images(
        self, tokens: mx.array, caches: Sequence[Any], images: Sequence[tuple[int, mx.array]]
    ) -> mx.array:
        """`forward` over a (1, L) chunk whose positions from each `start` on hold the
        `features` ((n, hidden), in order) instead of their tokens' embeddings."""
        ...


@runtime_checkable
class GridVision(VisionModel, Protocol):
    """A vision model that takes each image at about its own size, as a grid of patches,
    and places its tokens on that grid (Qwen's multimodal RoPE; see the module docstring)."""

    @property
    def image_grid(self) -> GridResize: ...

    def image_tokens(self, shape: Sequence[int]) -> int:
        """The tokens of an image whose pixels have `shape`; ValueError if it cannot be."""
        ...

    def rope_shift(self, images: Sequence[PromptImage]) -> int:
        """Rotary position minus offset, for the tokens after all of `images`."""
        ...

    def forward_placed(
        self,
        tokens: mx.array,
        caches: Sequence[Any],
        images: Sequence[tuple[int, mx.array]],
        placed: Sequence[PromptImage],
        offset: int,
    ) -> mx.array:
        """`forward_images` over the chunk at `offset` of a prompt whose images are
        `placed` (the chunk's rotary positions come from them)."""
        ...

    def forward_shifted(
        self, tokens: mx.array, caches: Sequence[Any], shift: int | mx.array
    ) -> mx.array:
        """`forward` with each row's rotary positions moved by `shift` ((B,) or one)."""
        ...


def vision_of(model: object) -> VisionModel | None:
    return model if isinstance(model, VisionModel) else None


def grid_of(model: object) -> GridVision | None:
    return model if isinstance(model, GridVision) else None


def decode_forward(
    model: Any, tokens: mx.array, caches: Sequence[Any], shifts: Sequence[int]
) -> mx.array:
    """`model.forward` over a decode step's (B, 1) tokens whose rows' rotary positions
    are their offsets plus `shifts` (PromptImages.shift; all 0 for text)."""
    if not any(shifts):
        out: mx.array = model.forward(tokens, caches)
        return out
    grid = grid_of(model)
    if grid is None:
        raise ValueError("shifted positions need a model with multimodal RoPE")
    shift = shifts[0] if len(shifts) == 1 else mx.array(list(shifts), dtype=mx.int32)
    return grid.forward_shifted(tokens, caches, shift)


def vision_spec(
    model: object, token_text: Callable[[int], str | None], folder: Path | None
) -> VisionSpec | None:
    """The HTTP side's view of a vision model (None for a text model): `token_text` is
    the tokenizer's id -> text, `folder` holds preprocessor_config.json (if any)."""
    vision = vision_of(model)
    if vision is None:
        return None
    grid = grid_of(model)
    try:
        prep = Preprocessing.read(
            folder, vision.image_size, None if grid is None else grid.image_grid
        )
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
        self._grid = grid_of(model)
        self._images = tuple(images)
        self._features: dict[str, mx.array] = {}  # digest -> (tokens, hidden)
        # rotary position minus offset after the prompt's images (multimodal RoPE)
        self.shift = 0 if self._grid is None else self._grid.rope_shift(self._images)

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

    @property
    def causal(self) -> bool:
        """Whether a chunk may end anywhere in the prompt (a GridVision's images)."""
        return self._grid is not None

    def restore_points(self, boundaries: Iterable[int]) -> tuple[int, ...]:
        """`boundaries` (where the prompt's messages start) and where each image's span
        ends: a later request showing the same image with another question leaves this
        one there, so layers that cannot rewind (a hybrid's) need a snapshot there."""
        return tuple(sorted({*boundaries, *(i.end for i in self._images)}))

    def marks(self, points: Iterable[int]) -> list[int]:
        """The snapshot points a prefill may pause at: those not inside a span."""
        return [p for p in points if not any(i.start < p < i.end for i in self._images)]

    def chunk(self, offset: int, n: int) -> int:
        """`n`, the length of a chunk starting at `offset`, changed so it does not end
        inside a span: cut before a span it enters, or extended to the end of the span it
        starts in (never past the next pause point outside spans, never past the prompt's
        last token, which no span holds). A GridVision's images are causal: any `n`."""
        if self._grid is not None:
            return n
        end = offset + n
        for image in self._images:
            if image.start < end < image.end:
                end = image.start if image.start > offset else image.end
        return end - offset

    def forward(self, tokens: Sequence[int], caches: Sequence[Any], offset: int) -> mx.array:
        """The model over the chunk `tokens` at `offset`: its images' features in place."""
        x = mx.array(np.asarray(tokens, dtype=np.int32))[None]
        images = self._in_chunk(offset, offset + len(tokens))
        if self._grid is not None:
            return self._grid.forward_placed(x, caches, images, self._images, offset)
        if not images:
            return self._model.forward(x, caches)
        return self._model.forward_images(x, caches, images)

    def _in_chunk(self, start: int, end: int) -> list[tuple[int, mx.array]]:
        inside = [i for i in self._images if i.start < end and i.end > start]
        if self._grid is None and any(i.end > end for i in inside):
            raise ValueError("a prefill chunk may not end inside an image (see chunk())")
        self._encode([i for i in inside if i.digest not in self._features])
        out = []
        for image in inside:
            lo, hi = max(image.start, start), min(image.end, end)
            features = self._features[image.digest]
            out.append((lo - start, features[lo - image.start : hi - image.start]))
        # prefill only moves forward: features no later span needs are let go
        later = {i.digest for i in self._images if i.end > end}
        for digest in [d for d in self._features if d not in later]:
            del self._features[digest]
        return out

    def _encode(self, images: Sequence[PromptImage]) -> None:
        todo = list({i.digest: i for i in images}.values())
        for shape in dict.fromkeys(i.shape for i in todo):  # one batch per size
            same = [i for i in todo if i.shape == shape]
            pixels = mx.array(np.stack([pixel_array(i.pixels, i.shape) for i in same]))
            features = self._model.encode_images(pixels)
            mx.eval(features)
            for n, image in enumerate(same):
                self._features[image.digest] = features[n]


def _tokens(model: VisionModel, shape: tuple[int, int, int]) -> int:
    """The tokens an image of pixels of `shape` takes; ValueError if the model cannot
    take them."""
    grid = grid_of(model)
    if grid is not None:
        return grid.image_tokens(shape)
    size = model.image_size
    if shape != (3, size, size):
        raise ValueError(f"pixels of shape {shape}; expected (3, {size}, {size})")
    return model.image_layout.tokens_per_image


def _check(model: VisionModel, images: Sequence[PromptImage], prompt: Sequence[int]) -> None:
    layout = model.image_layout
    previous_end = 0
    for n, image in enumerate(images, 1):
        where = f"image {n} of {len(images)}"
        try:
            tokens = _tokens(model, image.shape)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if image.length != tokens:
            raise ValueError(
                f"{where}: a span of {image.length} tokens; this model gives the image {tokens}"
            )
        if image.start < previous_end:
            raise ValueError(f"{where}: spans must be in order and not overlap")
        if image.end >= len(prompt):
            raise ValueError(f"{where}: the prompt must go on after an image's span")
        if any(t != layout.image_token_id for t in prompt[image.start : image.end]):
            raise ValueError(f"{where}: its span does not hold the model's image tokens")
        previous_end = image.end
