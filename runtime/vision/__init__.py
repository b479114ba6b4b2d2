"""Images: preprocessing (preprocess.py) and image spans in prompts (spans.py).

Only preprocessing is exported here: the CLI imports it at start-up, before
runtime.backend.configure() loads the BLAS that must precede MLX, and spans.py imports
MLX. Import the span names from runtime.vision.spans."""

from __future__ import annotations

from runtime.vision.preprocess import (
    GridResize,
    ImageError,
    ImageLayout,
    ImageLimits,
    ImageTooLarge,
    ImageUnreadable,
    PreparedImage,
    Preprocessing,
    TooManyImages,
    VisionSpec,
    digest,
    open_image,
    prepare_image,
    preprocess,
)

__all__ = [
    "GridResize",
    "ImageError",
    "ImageLayout",
    "ImageLimits",
    "ImageTooLarge",
    "ImageUnreadable",
    "PreparedImage",
    "Preprocessing",
    "TooManyImages",
    "VisionSpec",
    "digest",
    "open_image",
    "prepare_image",
    "preprocess",
]
