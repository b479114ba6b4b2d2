"""Gemma 3 with vision against transformers: the SigLIP tower and projector, logits with
images in the prompt (each image's positions attend both ways), prefill chunks that never
split an image, the checkpoint layouts, pixel preprocessing, and the engine's prefix
cache keyed by image content."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from runtime.engine import Engine  # noqa: E402
from runtime.engine.runner import ModelRunner, RunnerSettings  # noqa: E402
from runtime.load.loader import load  # noqa: E402
from runtime.models import build_model  # noqa: E402
from runtime.types import (  # noqa: E402
    Finished,
    GenerationRequest,
    PromptImage,
    SamplingParams,
    TextDelta,
)
from runtime.vision.preprocess import (  # noqa: E402
    ImageLimits,
    Preprocessing,
    digest,
    open_image,
    prepare_image,
    preprocess,
)
from runtime.vision.spans import PromptImages, VisionModel, vision_of  # noqa: E402
from tests.support.model_checks import TinyModels  # noqa: E402
from tests.support.tiny_models import VOCAB, _gemma3_text_config, load_mlx, save_tiny  # noqa: E402
from tests.support.tiny_qwen_vision import prefill  # noqa: E402

BOI, EOI, IMAGE = 998, 999, 1000  # inside the tiny vocabulary
SIZE = 56  # 4 x 4 patches of 14 pixels
# name -> mm_tokens_per_image: 4 pools 2 x 2 patches; 16 is longer than the text
# model's sliding window (8), so the window bounds attention inside an image
VARIANTS = {"pooled": 4, "wide": 16}
# tokens named for the tokenizer the engine and server tests load
SPECIAL = {
    1: "<eos>",
    2: "<bos>",
    3: "<start_of_turn>",
    4: "<end_of_turn>",
    BOI: "<start_of_image>",
    EOI: "<end_of_image>",
    IMAGE: "<image_soft_token>",
}


def _gemma3_vision(tokens: int) -> Any:
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": SIZE,
        "patch_size": 14,
        "vision_use_head": tokens == 4,  # a head in the checkpoint, which Gemma 3 ignores
    }
    config = transformers.Gemma3Config(
        text_config=_gemma3_text_config(),
        vision_config=vision,
        mm_tokens_per_image=tokens,
        image_token_index=IMAGE,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )
    return transformers.Gemma3ForConditionalGeneration(config)


def save_tiny_vision(name: str, directory: Path) -> Any:
    """Save the `name` variant (with a tokenizer, so runtime.load.loader loads the folder);
    return the torch model."""
    tokens = VARIANTS[name]
    model = save_tiny((lambda: _gemma3_vision(tokens), None), directory)
    write_vision_tokenizer(directory)
    return model


def write_vision_tokenizer(folder: Path) -> None:
    """A word-level tokenizer ("w<i>" is token i) whose image and turn tokens carry
    Gemma 3's names, as special tokens."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {SPECIAL.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL.values()])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<end_of_turn>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, save_tiny_vision)


def _pixels(seed: int, n: int = 1) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


def _prompt(per_image: int, texts: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """texts[0] <image> texts[1] <image> ... texts[-1]; returns (tokens, image starts)."""
    tokens, starts = list(texts[0]), []
    for text in texts[1:]:
        tokens.append(BOI)
        starts.append(len(tokens))
        tokens += [IMAGE] * per_image + [EOI, *text]
    return tokens, starts


def _images(pixels: np.ndarray[Any, Any], starts: Sequence[int], n: int) -> list[PromptImage]:
    return [
        PromptImage(p.tobytes(), (3, SIZE, SIZE), digest(p), s, n)
        for p, s in zip(pixels, starts, strict=True)
    ]


def _mlx_vision(directory: Path) -> Any:
    model = load_mlx(directory)
    assert isinstance(model, VisionModel) and vision_of(model) is model
    return model


def _torch_logits(hf: Any, tokens: Sequence[int], pixels: np.ndarray[Any, Any]) -> Any:
    ids = torch.tensor([list(tokens)])
    with torch.no_grad():
        out = hf(
            input_ids=ids,
            pixel_values=torch.from_numpy(pixels),
            token_type_ids=(ids == IMAGE).long(),
        )
    return out.logits.numpy()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_vision_tower_and_projector_match_transformers(name: str, tiny: TinyModels) -> None:
    hf, directory = tiny[name]
    model = _mlx_vision(directory)
    pixels = _pixels(0, 2)
    with torch.no_grad():
        tower = hf.model.vision_tower(pixel_values=torch.from_numpy(pixels)).last_hidden_state
        features = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output
    ours_tower = np.array(model.vision_tower(mx.array(pixels)))
    ours = np.array(model.encode_images(mx.array(pixels)))
    assert ours.shape == (2, VARIANTS[name], 64)
    np.testing.assert_allclose(ours_tower, tower.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours, features.numpy(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_with_images_match_transformers(name: str, tiny: TinyModels) -> None:
    hf, directory = tiny[name]
    model = _mlx_vision(directory)
    per_image = VARIANTS[name]
    tokens, starts = _prompt(per_image, [[5, 17, 40], [9, 8, 7, 6, 5, 4, 3], [33, 2]])
    pixels = _pixels(1, 2)
    images = PromptImages(model, _images(pixels, starts, per_image), tokens)
    ours, _ = prefill(model, images, tokens, len(tokens))
    expected = _torch_logits(hf, tokens, pixels)
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)
    # the same prompt read as text: the image's features and open mask change everything
    text = np.array(model(mx.array([tokens]), model.make_caches()))
    assert np.abs(text - expected).max() > 1e-2


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7])
def test_prefill_chunks_never_split_an_image(name: str, chunk: int, tiny: TinyModels) -> None:
    _, directory = tiny[name]
    model = _mlx_vision(directory)
    per_image = VARIANTS[name]
    tokens, starts = _prompt(per_image, [[5, 17], [9, 8, 7], [33, 2, 1]])
    images = PromptImages(model, _images(_pixels(2, 2), starts, per_image), tokens)
    whole, _ = prefill(model, images, tokens, len(tokens))
    chunked, ends = prefill(model, images, tokens, chunk)
    assert not any(s < e < s + per_image for s in starts for e in ends)
    np.testing.assert_allclose(chunked, whole, atol=1e-4, rtol=0)


def test_prompt_images_are_checked_against_the_prompt(tiny: TinyModels) -> None:
    model = _mlx_vision(tiny["pooled"][1])
    tokens, starts = _prompt(4, [[5], [6]])
    good = _images(_pixels(3), starts, 4)
    PromptImages(model, good, tokens)
    bad = [
        (_images(_pixels(3), [starts[0] + 1], 4), "image tokens"),
        (_images(_pixels(3), starts, 3), "tokens"),
        ([PromptImage(b"\0" * 12, (3, 1, 1), "x", starts[0], 4)], "shape"),
    ]
    for images, words in bad:
        with pytest.raises(ValueError, match=words):
            PromptImages(model, images, tokens)
    with pytest.raises(ValueError, match="go on after"):
        PromptImages(model, good, tokens[: starts[0] + 4])
    config = json.loads((tiny["pooled"][1] / "config.json").read_text())
    with pytest.raises(ValueError, match="no vision"):
        PromptImages.of(build_model(config["text_config"]), good, tokens)


# -- checkpoint layouts --------------------------------------------------------------------


def _hub(name: str) -> str:
    """transformers 5's saved names -> the hub checkpoints' (and mlx-vlm's)."""
    if name.startswith("vision_tower."):
        return "vision_tower.vision_model." + name[len("vision_tower.") :]
    return name


def _transformers4(name: str) -> str:
    hub = _hub(name)
    if hub.startswith("language_model.model."):
        return "model.language_model." + hub[len("language_model.model.") :]
    return "model." + hub


def _channels_last(name: str, value: mx.array) -> mx.array:
    return value.transpose(0, 2, 3, 1) if name.endswith("patch_embedding.weight") else value


LAYOUTS: dict[str, Callable[[str, mx.array], tuple[str, mx.array]]] = {
    "hub": lambda k, v: (_hub(k), v),
    "transformers4": lambda k, v: (_transformers4(k), v),
    "mlx": lambda k, v: (_hub(k), _channels_last(k, v)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_checkpoint_layouts_load_alike(layout: str, tiny: TinyModels, tmp_path: Path) -> None:
    _, directory = tiny["pooled"]
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    renamed = dict(LAYOUTS[layout](k, v) for k, v in weights.items())
    assert renamed.keys() != weights.keys()
    mx.save_safetensors(str(tmp_path / "model.safetensors"), renamed)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    reference, model = _mlx_vision(directory), _mlx_vision(tmp_path)
    pixels = mx.array(_pixels(4))
    np.testing.assert_array_equal(
        np.array(model.encode_images(pixels)), np.array(reference.encode_images(pixels))
    )
    tokens = mx.array([[5, 6, 7]])
    np.testing.assert_array_equal(
        np.array(model(tokens, model.make_caches())),
        np.array(reference(tokens, reference.make_caches())),
    )


def test_checkpoint_without_vision_weights_loads_the_text_model(
    tiny: TinyModels, tmp_path: Path
) -> None:
    _, directory = tiny["pooled"]
    weights = mx.load(str(directory / "model.safetensors"))
    assert isinstance(weights, dict)
    text = {k: v for k, v in weights.items() if k.startswith("language_model.")}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), text)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((directory / name).read_text())
    loaded = load(tmp_path)
    assert vision_of(loaded.model) is None and loaded.vision is None
    vision = load(directory)
    assert vision.vision is not None
    assert vision.vision.marker == "<start_of_image>"
    assert vision.vision.expansion == (
        "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    )


# -- preprocessing ---------------------------------------------------------------------


def _sample_images() -> list[Image.Image]:
    rng = np.random.default_rng(5)

    def noise(*shape: int) -> Any:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    palette = Image.fromarray(noise(64, 48, 3), "RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 3
    return [
        Image.fromarray(noise(37, 91, 4), "RGBA"),
        Image.fromarray(noise(120, 40), "L"),
        Image.fromarray(noise(30, 30, 2), "LA"),
        palette,
        Image.fromarray(noise(80, 100, 4), "CMYK"),
        Image.fromarray(noise(SIZE, SIZE, 3), "RGB"),
        Image.fromarray(noise(300, 200, 3), "RGB"),
    ]


# Gemma3Processor calls its image processor with do_convert_rgb=True (the checkpoint's
# preprocessor_config.json leaves it null)
_AS_GEMMA3_PROCESSOR = {"do_convert_rgb": True, "return_tensors": "np"}


def _processor(directory: Path, size: int, **extra: Any) -> Any:
    """transformers' processor as a Gemma 3 checkpoint's preprocessor_config.json sets it."""
    config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": size, "width": size},
        **extra,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return transformers.Gemma3ImageProcessorPil.from_pretrained(str(directory))


@pytest.mark.parametrize(("size", "resample"), [(SIZE, 2), (896, 2), (SIZE, 3)])
def test_preprocessing_equals_the_processor(size: int, resample: int, tmp_path: Path) -> None:
    processor = _processor(tmp_path, size, resample=resample)
    prep = Preprocessing.read(tmp_path, size)
    assert (prep.height, prep.width, prep.resample) == (size, size, resample)
    for image in _sample_images():
        expected = processor(images=image, **_AS_GEMMA3_PROCESSOR)["pixel_values"][0]
        ours = preprocess(image, prep)
        assert ours.dtype == np.float32 and ours.shape == (3, size, size)
        np.testing.assert_array_equal(ours, expected, err_msg=image.mode)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_encoded_images_preprocess_like_the_processor(fmt: str, tmp_path: Path) -> None:
    processor = _processor(tmp_path, SIZE)
    image = _sample_images()[6]
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    data = buffer.getvalue()
    prepared = prepare_image(data, Preprocessing(SIZE, SIZE), ImageLimits())
    expected = processor(images=Image.open(io.BytesIO(data)), **_AS_GEMMA3_PROCESSOR)
    pixels = np.frombuffer(prepared.pixels, np.float32).reshape(prepared.shape)
    np.testing.assert_array_equal(pixels, expected["pixel_values"][0])
    assert prepared.digest == digest(pixels)
    assert open_image(data, ImageLimits()).format == fmt


# -- the engine: prefix cache keyed by image content -----------------------------------


class _Counting:
    """Counts the images a model's vision encoder sees."""

    def __init__(self, model: Any) -> None:
        self.images = 0
        self._encode = model.encode_images

    def __call__(self, pixels: mx.array) -> mx.array:
        self.images += int(pixels.shape[0])
        out: mx.array = self._encode(pixels)
        return out


@pytest.fixture(scope="module")
def engine(tiny: TinyModels) -> Iterator[tuple[Engine, Any, _Counting]]:
    """The engine on the pooled model (prefill chunks of 3 tokens, shorter than an
    image's placeholder), the same model loaded apart as the reference, and a count of
    the images the engine's encoder saw."""
    directory = tiny["pooled"][1]
    loaded = load(directory, dtype="float32")  # as the reference, on any device
    model: Any = loaded.model
    counter = _Counting(model)
    model.encode_images = counter
    settings = RunnerSettings(prefill_chunk=3, prefix_cache_bytes=1 << 28, max_batch=2)
    eng = Engine(ModelRunner(loaded, settings))
    eng.start()
    yield eng, _mlx_vision(directory), counter
    eng.stop()


def _generate(eng: Engine, tokens: Sequence[int], images: Sequence[PromptImage]) -> Any:
    request = GenerationRequest(
        tuple(tokens), 6, SamplingParams(temperature=0.0), images=tuple(images)
    )
    out: list[int] = []
    done = None
    for event in eng.submit(request):
        if isinstance(event, TextDelta):
            out += event.token_ids
        else:
            done = event
    assert isinstance(done, Finished) and done.error is None, done
    return out, done.stats.cached_tokens


def _greedy(model: Any, tokens: Sequence[int], images: Sequence[PromptImage], n: int) -> Any:
    """The reference: one-shot prefill, then greedy decoding, caches fresh."""
    caches = model.make_caches()
    reader = PromptImages(model, images, tokens)
    reader.forward(tokens[:-1], caches, 0)
    out, last = [], tokens[-1]
    for _ in range(n):
        logits = model.logits(model.forward(mx.array([[last]]), caches))
        last = int(np.argmax(np.array(logits[0, -1])))
        out.append(last)
    return out


def test_prefix_cache_keys_images_by_content(engine: Any) -> None:
    eng, model, counter = engine
    tokens, starts = _prompt(4, [[2, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    x, y = _images(_pixels(6), starts, 4), _images(_pixels(7), starts, 4)
    first, _ = _generate(eng, tokens, x)
    assert first == _greedy(model, tokens, x, 6)
    encoded = counter.images
    again, cached = _generate(eng, tokens, x)
    assert again == first and cached > starts[0] + 4  # the image's span came from the cache
    assert counter.images == encoded  # and its encoder did not run again
    other, cached = _generate(eng, tokens, y)
    assert cached <= starts[0]  # another image never reuses the first one's state
    assert other == _greedy(model, tokens, y, 6) and counter.images == encoded + 1


def test_one_encoding_for_an_image_shown_twice(engine: Any) -> None:
    eng, model, counter = engine
    tokens, starts = _prompt(4, [[2, 30, 31], [32, 33], [34, 35, 36]])
    pixels = _pixels(8)
    images = _images(np.concatenate([pixels, pixels]), starts, 4)
    before = counter.images
    out, _ = _generate(eng, tokens, images)
    assert counter.images == before + 1
    assert out == _greedy(model, tokens, images, 6)
