"""Images in chat requests, for a model with vision: read each image's source
(image_fetch), decode and preprocess it (runtime.vision), and put the model's placeholder
for it in the prompt. Every failure is a 400 that names the image and what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.errors import InvalidRequest
from gateway.core.image_fetch import ImagePolicy, read_source
from runtime.types import PromptImage
from runtime.vision import (
    ImageError,
    PreparedImage,
    VisionSpec,
    prepare_image,
)
from templates import Rendered, splice
from templates.types import ImagePart, Message


def image_sources(messages: Sequence[Message]) -> list[str]:
    """Every image's source, in the order the messages (and so the prompt) hold them."""
    return [
        part.source
        for m in messages
        if isinstance(m.content, tuple)
        for part in m.content
        if isinstance(part, ImagePart)
    ]


def require_vision(spec: VisionSpec | None, model_id: str, param: str) -> VisionSpec:
    if spec is None:
        raise InvalidRequest(
            f"The model {model_id!r} has no vision: send text content only, or serve a "
            "model with vision.",
            param=param,
            code="model_has_no_vision",
        )
    return spec


def expand_markers(
    text: str, spec: VisionSpec, count: int, param: str, lengths: Sequence[int] | None = None
) -> str:
    """The rendered prompt with each image marker the template wrote replaced by the
    model's full placeholder (Gemma 3: a blank line, <start_of_image>, 256 image tokens,
    <end_of_image>, a blank line; Qwen: as many <|image_pad|> as the image has tokens).
    `lengths`: each image's tokens, needed where they depend on the image's size."""
    return expand_rendered(Rendered(text), spec, count, param, lengths).text


def expand_rendered(
    rendered: Rendered,
    spec: VisionSpec,
    count: int,
    param: str,
    lengths: Sequence[int] | None = None,
) -> Rendered:
    """`expand_markers` on a rendered prompt, its content spans moved along."""
    expansions = _expansions(rendered.text, spec, count, param, lengths)
    try:
        return splice(rendered, spec.marker, expansions)
    except ValueError:  # a marker in message text
        raise _marker_error(rendered.text.count(spec.marker), count, spec, param) from None


def _marker_error(found: int, count: int, spec: VisionSpec, param: str) -> InvalidRequest:
    return InvalidRequest(
        f"The prompt holds {found} image markers ({spec.marker}) for {count} images: "
        f"remove {spec.marker} from the messages' text.",
        param=param,
        code="invalid_image",
    )


def _expansions(
    text: str, spec: VisionSpec, count: int, param: str, lengths: Sequence[int] | None
) -> list[str]:
    """What each image marker in `text` becomes."""
    found = text.count(spec.marker)
    if found != count:
        raise _marker_error(found, count, spec, param)
    if lengths is None:
        if spec.preprocessing.grid is not None:
            raise InvalidRequest(
                "This model gives each image as many tokens as its size makes: the images "
                "must be read to count them.",
                param=param,
                code="invalid_image",
            )
        return [spec.expansion] * found
    return [spec.placeholder(n) for n in lengths]


def image_starts(
    tokens: Sequence[int], spec: VisionSpec, lengths: Sequence[int], param: str
) -> list[int]:
    """Where each image's span of image tokens starts in the encoded prompt: the runs of
    image tokens, cut into the images' `lengths` in order."""
    image = spec.layout.image_token_id
    starts: list[int] = []
    filled = True  # every run of image tokens is exactly the next images' spans
    i = 0
    while i < len(tokens) and filled:
        if tokens[i] != image:
            i += 1
            continue
        j = i
        while j < len(tokens) and tokens[j] == image:
            j += 1
        while i < j and len(starts) < len(lengths):
            starts.append(i)
            i += lengths[len(starts) - 1]
        filled = i == j
    last = starts[-1] + lengths[-1] if starts else 0
    if not filled or len(starts) != len(lengths) or last >= len(tokens):
        raise InvalidRequest(
            "The messages' text holds the model's image placeholder tokens: remove them "
            "(images go in image parts).",
            param=param,
            code="invalid_image",
        )
    return starts


def read_images(
    spec: VisionSpec, sources: Sequence[str], policy: ImagePolicy, param: str
) -> list[PreparedImage]:
    """Read, check and preprocess every image."""
    count = len(sources)
    try:
        policy.limits.check_count(count)
    except ImageError as exc:
        raise InvalidRequest(f"{exc}.", param=param, code=exc.code) from None
    used = 0
    out = []
    for n, source in enumerate(sources, 1):
        try:
            data = read_source(source, policy, used)
            used += len(data)
            out.append(prepare_image(data, spec.preprocessing, policy.limits))
        except ImageError as exc:
            where = f"image {n} of {count} ({_short(source)})"
            raise InvalidRequest(f"{where}: {exc}.", param=param, code=exc.code) from None
    return out


def place_images(
    spec: VisionSpec, images: Sequence[PreparedImage], tokens: Sequence[int], param: str
) -> tuple[PromptImage, ...]:
    """Each read image on its span of the encoded prompt."""
    lengths = [spec.tokens(i.shape) for i in images]
    starts = image_starts(tokens, spec, lengths, param)
    return tuple(
        PromptImage(i.pixels, i.shape, i.digest, start, n)
        for i, start, n in zip(images, starts, lengths, strict=True)
    )


def _short(source: str, most: int = 80) -> str:
    if source.startswith("data:"):
        return source[: source.find(",") + 1] + "..." if "," in source else "data:..."
    return source if len(source) <= most else source[: most - 3] + "..."
