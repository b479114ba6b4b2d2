"""Images for vision models: decode with Pillow under limits, preprocess to the pixel
values the model's processor produces, and hash them.

No MLX here: the HTTP side runs this in a worker thread and hands the engine plain bytes
(runtime.types.PromptImage).

Preprocessing is transformers' Gemma3ImageProcessor (PIL backend) step by step, so the
pixel values are the same bits: transparency composited on white and converted to RGB,
resized by Pillow to the model's square size with the processor's filter (bilinear
unless preprocessor_config.json says otherwise), rescaled by 1/255 in float64 and cast to
float32, then (x - mean) / std in float32, channels first. Pan-and-scan crops are not
made (the processor's default).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

log = logging.getLogger(__name__)

# What Pillow may decode: the formats chat APIs accept, plus BMP. Never formats that
# shell out (EPS) or are rarely audited.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, the processor's default
_ORIENTATION = 0x0112  # the EXIF tag


class ImageError(ValueError):
    """An image cannot be used; the message says what is wrong (the gateway answers 400)."""

    code = "invalid_image"


class ImageTooLarge(ImageError):
    code = "image_too_large"


class ImageUnreadable(ImageError):
    code = "image_unreadable"


class TooManyImages(ImageError):
    code = "too_many_images"


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send: bytes per image (encoded), pixels per image (checked
    from the header, before decoding), images, and encoded bytes over all its images."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_images: int = 16
    max_total_bytes: int = 64 * 1024 * 1024

    def check_count(self, count: int) -> None:
        if count > self.max_images:
            raise TooManyImages(
                f"the request has {count} images; at most {self.max_images} are accepted"
            )

    def check_bytes(self, size: int, total: int) -> None:
        """`size`: one image's encoded bytes; `total`: the request's so far, with it."""
        if size > self.max_bytes:
            raise ImageTooLarge(f"the image is {size} bytes; at most {self.max_bytes} are accepted")
        if total > self.max_total_bytes:
            raise ImageTooLarge(
                f"the request's images are {total} bytes together; at most "
                f"{self.max_total_bytes} are accepted"
            )


@dataclass(frozen=True)
class Preprocessing:
    """How pixels are prepared: the processor's fields (preprocessor_config.json)."""

    height: int
    width: int
    resample: int = _BILINEAR
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def read(cls, folder: Path | None, image_size: int) -> Preprocessing:
        """The folder's preprocessor_config.json, at the model's `image_size` (the size
        the vision tower takes; a config naming another size is overridden, loudly)."""
        config: Mapping[str, Any] = {}
        file = None if folder is None else folder / "preprocessor_config.json"
        if file is not None and file.is_file():
            try:
                loaded = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable %s: %s", file, exc)
            else:
                config = loaded if isinstance(loaded, dict) else {}
        return cls.from_config(config, image_size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], image_size: int) -> Preprocessing:
        size = config.get("size")
        if isinstance(size, Mapping) and (size.get("height"), size.get("width")) != (
            image_size,
            image_size,
        ):
            log.warning("preprocessor size %s differs from the model's %d", size, image_size)
        if config.get("do_pan_and_scan"):
            log.warning("pan-and-scan crops are not made; each image is one square")
        d = cls(image_size, image_size)
        return cls(
            height=image_size,
            width=image_size,
            resample=int(config.get("resample", d.resample)),
            rescale=float(config.get("rescale_factor", d.rescale)),
            mean=_triple(config.get("image_mean"), d.mean),
            std=_triple(config.get("image_std"), d.std),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
        )


def _triple(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    items = [float(v) for v in value]
    if len(items) != 3:
        raise ValueError(f"expected 3 channel values, got {value!r}")
    return (items[0], items[1], items[2])


@dataclass(frozen=True)
class ImageLayout:
    """An image's place in a vision model's prompt. The chat template writes the token
    `start_id` for each image; the processor turns that into `wrap`, the start token,
    `tokens_per_image` image tokens, the `end_id` token and `wrap` again (Gemma 3: a
    blank line either side). The image tokens' embeddings are the image's features."""

    image_token_id: int
    tokens_per_image: int
    start_id: int | None = None
    end_id: int | None = None
    wrap: str = ""


@dataclass(frozen=True)
class VisionSpec:
    """What the HTTP side needs of a vision model: the text the template writes for an
    image (`marker`), the text each marker becomes before tokenizing (`expansion`), and
    the preprocessing of its pixels."""

    layout: ImageLayout
    marker: str
    expansion: str
    preprocessing: Preprocessing

    @classmethod
    def build(
        cls, layout: ImageLayout, token_text: Callable[[int], str | None], prep: Preprocessing
    ) -> VisionSpec:
        """`token_text`: the tokenizer's id -> token text."""

        def text(token_id: int | None) -> str:
            name = None if token_id is None else token_text(token_id)
            if token_id is not None and name is None:
                raise ValueError(f"the vocabulary has no token {token_id} for images")
            return name or ""

        image = text(layout.image_token_id)
        start, end = text(layout.start_id), text(layout.end_id)
        body = start + image * layout.tokens_per_image + end
        return cls(layout, start or image, layout.wrap + body + layout.wrap, prep)


@dataclass(frozen=True)
class PreparedImage:
    """Pixel values ready for the vision tower, and their content hash."""

    pixels: bytes
    shape: tuple[int, int, int]
    digest: str


def open_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """Decode `data` (one of FORMATS), refusing oversized images before decoding them."""
    if not data:
        raise ImageUnreadable("the image is empty")
    limits.check_bytes(len(data), len(data))
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image has too many pixels ({exc})") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        kinds = ", ".join(FORMATS)
        raise ImageUnreadable(f"the data is not an image in a supported format ({kinds})") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageUnreadable(f"the image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageTooLarge(
            f"the image is {width}x{height} = {width * height} pixels; at most "
            f"{limits.max_pixels} are accepted"
        )
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"the image has too many pixels ({exc})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageUnreadable(f"the {image.format} image is truncated or corrupt ({exc})") from None
    return _upright(image)


def _upright(image: Image.Image) -> Image.Image:
    """Apply the EXIF orientation, as transformers' load_image does for files and URLs."""
    try:
        if image.getexif().get(_ORIENTATION, 1) == 1:
            return image
        turned = ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, KeyError, TypeError):
        return image  # a malformed EXIF block: keep the pixels as stored
    return image if turned is None else turned


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, prep: Preprocessing) -> np.ndarray[Any, np.dtype[np.float32]]:
    """(3, height, width) float32 pixel values, as the model's processor makes them."""
    rgb = to_rgb(image)
    if rgb.size != (prep.width, prep.height):
        rgb = rgb.resize((prep.width, prep.height), resample=prep.resample)
    pixels: np.ndarray[Any, Any] = np.asarray(rgb)
    if prep.do_rescale:
        pixels = (pixels.astype(np.float64) * prep.rescale).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if prep.do_normalize:
        mean = np.asarray(prep.mean, dtype=np.float32)
        std = np.asarray(prep.std, dtype=np.float32)
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)


def digest(pixels: np.ndarray[Any, Any]) -> str:
    """A content hash of pixel values (shape included): the prefix cache's image key."""
    h = hashlib.sha256(repr(tuple(pixels.shape)).encode())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()


def prepare_image(data: bytes, prep: Preprocessing, limits: ImageLimits) -> PreparedImage:
    """Decode, check and preprocess one encoded image."""
    pixels = preprocess(open_image(data, limits), prep)
    shape = (int(pixels.shape[0]), int(pixels.shape[1]), int(pixels.shape[2]))
    return PreparedImage(pixels.tobytes(), shape, digest(pixels))


def pixel_array(pixels: bytes, shape: Sequence[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
    """The float32 array `PreparedImage.pixels` / `PromptImage.pixels` hold."""
    expected = int(np.prod(shape)) * 4
    if len(pixels) != expected:
        raise ValueError(f"{len(pixels)} pixel bytes for shape {tuple(shape)} ({expected})")
    return np.frombuffer(pixels, dtype=np.float32).reshape(tuple(shape))
