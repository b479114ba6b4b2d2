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

Qwen's vision models (`GridResize`) take each image at about its own size instead, as
Qwen2VLImageProcessor (PIL backend) does: "smart resize" to sides that are multiples of
patch * merge pixels, the area within [min_pixels, max_pixels], the aspect ratio kept
(bicubic unless the config says otherwise); then the same rescale and normalisation.
The model cuts the pixels into patches (runtime/models/qwen3_vision.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
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
_BICUBIC = 3  # Qwen2VLImageProcessor's default
_MAX_ASPECT = 200  # smart_resize refuses images whose long side is more times the short
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
class GridResize:
    """Images at their own size on a grid of patches (Qwen's vision models): each side a
    multiple of `patch_size * merge_size` pixels, the area within [min_pixels,
    max_pixels]. An image of H x W pixels gives (H / patch) x (W / patch) patches, every
    merge x merge block of them one token. The defaults are Qwen2VLImageProcessor's."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """transformers' smart_resize: the (height, width) an image is resized to."""
        if max(height, width) / min(height, width) > _MAX_ASPECT:
            raise ImageError(
                f"the image is {width}x{height}: its sides may differ at most {_MAX_ASPECT}-fold"
            )
        f = self.factor
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(f, math.floor(height / beta / f) * f)
            w = max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid(self, shape: Sequence[int]) -> tuple[int, int]:
        """(rows, columns) of tokens for pixels of `shape` (channels, height, width)."""
        f = self.factor
        if len(shape) != 3 or shape[1] % f or shape[2] % f or not shape[1] or not shape[2]:
            raise ValueError(
                f"pixels of shape {tuple(shape)}: height and width must be multiples of {f}"
            )
        return shape[1] // f, shape[2] // f

    def tokens(self, shape: Sequence[int]) -> int:
        rows, columns = self.grid(shape)
        return rows * columns

    def with_config(self, config: Mapping[str, Any]) -> GridResize:
        """The pixel bounds a preprocessor_config.json sets (size.shortest_edge and
        size.longest_edge, or the older min_pixels / max_pixels); the patch sizes stay the
        model's (a config naming others is overridden, loudly)."""
        size = config.get("size")
        size = size if isinstance(size, Mapping) else {}
        low = size.get("shortest_edge", config.get("min_pixels"))
        high = size.get("longest_edge", config.get("max_pixels"))
        for key, ours in (("patch_size", self.patch_size), ("merge_size", self.merge_size)):
            if config.get(key) is not None and int(config[key]) != ours:
                log.warning(
                    "preprocessor %s %s differs from the model's %d", key, config[key], ours
                )
        out = GridResize(
            self.patch_size,
            self.merge_size,
            self.temporal_patch_size,
            self.min_pixels if low is None else int(low),
            self.max_pixels if high is None else int(high),
        )
        if not 0 < out.min_pixels <= out.max_pixels:
            raise ValueError(f"image pixel bounds {out.min_pixels}..{out.max_pixels} are empty")
        return out


@dataclass(frozen=True)
class Preprocessing:
    """How pixels are prepared: the processor's fields (preprocessor_config.json).
    With `grid`, images keep about their own size (height and width are unused)."""

    height: int
    width: int
    resample: int = _BILINEAR
    rescale: float = 1 / 255
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    do_rescale: bool = True
    do_normalize: bool = True
    grid: GridResize | None = None

    @classmethod
    def read(
        cls, folder: Path | None, image_size: int, grid: GridResize | None = None
    ) -> Preprocessing:
        """The folder's preprocessor_config.json, at the model's `image_size` (the size
        the vision tower takes; a config naming another size is overridden, loudly), or
        on the model's `grid` (its pixel bounds from the config)."""
        config: Mapping[str, Any] = {}
        file = None if folder is None else folder / "preprocessor_config.json"
        if file is not None and file.is_file():
            try:
                loaded = json.loads(file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable %s: %s", file, exc)
            else:
                config = loaded if isinstance(loaded, dict) else {}
        if grid is not None:
            return cls.on_grid(config, grid)
        return cls.from_config(config, image_size)

    @classmethod
    def on_grid(cls, config: Mapping[str, Any], grid: GridResize) -> Preprocessing:
        """Qwen2VLImageProcessor's fields; mean and std default to 0.5, as Qwen3.5's
        checkpoints set them (the processor class's own default is CLIP's)."""
        d = cls(0, 0)
        return cls(
            height=0,
            width=0,
            resample=int(config.get("resample", _BICUBIC)),
            rescale=float(config.get("rescale_factor", d.rescale)),
            mean=_triple(config.get("image_mean"), d.mean),
            std=_triple(config.get("image_std"), d.std),
            do_rescale=bool(config.get("do_rescale", True)),
            do_normalize=bool(config.get("do_normalize", True)),
            grid=grid.with_config(config),
        )

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
    blank line either side). The image tokens' embeddings are the image's features.
    Without `start_id` the template writes one image token, which becomes the image's
    tokens (Qwen: between <|vision_start|> and <|vision_end|>, which the template
    writes); `tokens_per_image` 0: the count is each image's own (GridResize)."""

    image_token_id: int
    tokens_per_image: int
    start_id: int | None = None
    end_id: int | None = None
    wrap: str = ""


@dataclass(frozen=True)
class VisionSpec:
    """What the HTTP side needs of a vision model: the text the template writes for an
    image (`marker`), the text each marker becomes before tokenizing (`expansion`, for
    an image of the layout's tokens_per_image; `placeholder(n)` for one of n tokens),
    and the preprocessing of its pixels."""

    layout: ImageLayout
    marker: str
    expansion: str
    preprocessing: Preprocessing
    pieces: tuple[str, str, str] = ("", "", "")  # before the image tokens, one, after

    def tokens(self, shape: Sequence[int]) -> int:
        """The image tokens of an image whose pixels have `shape`."""
        grid = self.preprocessing.grid
        return self.layout.tokens_per_image if grid is None else grid.tokens(shape)

    def placeholder(self, tokens: int) -> str:
        before, image, after = self.pieces
        return before + image * tokens + after

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
        pieces = (layout.wrap + start, image, end + layout.wrap)
        expansion = pieces[0] + image * layout.tokens_per_image + pieces[2]
        return cls(layout, start or image, expansion, prep, pieces)


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
    height, width = prep.height, prep.width
    if prep.grid is not None:
        height, width = prep.grid.resize(rgb.height, rgb.width)
    if rgb.size != (width, height):
        rgb = rgb.resize((width, height), resample=prep.resample)
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
