"""Qwen3.5 with vision, dense and MoE, against transformers: the vision tower (patches,
interpolated position embeddings, 2D rotary, merger), logits with one and two images
(multimodal RoPE on the images' grids) and decode steps after them, prefill chunks
cutting images anywhere, preprocessing (smart resize, patches) and placeholders, and the
engine: greedy decoding after an image, the prefix cache keyed by image content, and an
image request batched next to a text one; the server advertises and reads images for
both. Checkpoint layouts: tests/runtime/models/test_models_qwen_vision_checkpoints.py."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from gateway.core.images import expand_markers, place_images  # noqa: E402
from gateway.core.models.build import build_served  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.engine.runner import ModelRunner, RunnerSettings  # noqa: E402
from runtime.load.loader import load  # noqa: E402
from runtime.models import qwen3_vision  # noqa: E402
from runtime.models.qwen3_vision import patchify  # noqa: E402
from runtime.types import (  # noqa: E402
    Finished,
    GenerationRequest,
    PromptImage,
    SamplingParams,
    TextDelta,
)
from runtime.vision.preprocess import (  # noqa: E402
    GridResize,
    ImageLimits,
    Preprocessing,
    digest,
    prepare_image,
    preprocess,
)
from runtime.vision.spans import PromptImages  # noqa: E402
from tests.support.live_server import live_server  # noqa: E402
from tests.support.model_checks import TinyModels  # noqa: E402
from tests.support.openai_checks import post  # noqa: E402
from tests.support.tiny_models import load_mlx  # noqa: E402
from tests.support.tiny_qwen_vision import (  # noqa: E402
    END,
    EOS,
    IMAGE,
    KINDS,
    MERGE,
    PATCH,
    START,
    hf_inputs,
    make,
    prefill,
    prompt,
    vision_model,
    write_preprocessor_config,
)
from tests.support.tiny_qwen_vision import pixels as _pixels  # noqa: E402

ATOL = 1e-4
# the tests that read the text model run over both kinds
BOTH = pytest.mark.parametrize("kind", list(KINDS))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory, make)


# -- against transformers --------------------------------------------------------------


def test_vision_tower_matches_transformers(tiny: TinyModels) -> None:
    hf, model = vision_model(tiny)
    # 8 x 16 and 12 x 8 patches (4 x 4 learned positions): two grids in one call there
    pictures = [_pixels(0, 32, 64), _pixels(1, 48, 32)]
    inputs = hf_inputs([], pictures, model)
    with torch.no_grad():
        out = hf.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    hidden, merged = out.last_hidden_state.numpy(), out.pooler_output.numpy()
    ours_hidden, ours = [], []
    for p in pictures:
        patches = patchify(mx.array(p[None]), model.args.vision)
        grid = (p.shape[1] // PATCH, p.shape[2] // PATCH)
        ours_hidden.append(np.array(model.visual.hidden_states(patches, grid))[0])
        ours.append(np.array(model.encode_images(mx.array(p[None])))[0])
    assert [o.shape for o in ours] == [(32, 64), (24, 64)]
    np.testing.assert_allclose(np.concatenate(ours_hidden), hidden, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(ours), merged, atol=1e-5, rtol=0)


def test_large_images_attend_in_query_blocks(
    tiny: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, model = vision_model(tiny)
    pixels = mx.array(_pixels(12, 32, 64)[None])  # 128 patches
    whole = np.array(model.encode_images(pixels))
    monkeypatch.setattr(qwen3_vision, "_MIN_BLOCK", 16)
    monkeypatch.setattr(qwen3_vision, "_SCORES", 2 * 128 * 40)  # blocks of 40 queries
    np.testing.assert_allclose(np.array(model.encode_images(pixels)), whole, atol=1e-6, rtol=0)


@BOTH
@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_match_transformers(count: int, kind: str, tiny: TinyModels) -> None:
    hf, model = vision_model(tiny, kind)
    # a wide image, then a tall one: the text after each moves by max(h, w) - h * w
    pictures = [_pixels(2, 16, 40), _pixels(3, 32, 16)][:count]
    texts = [[5, 17, 40], [9, 8, 7, 6, 5], [33, 2, 4]][: count + 1]
    tokens, images = prompt(pictures, texts)
    reader = PromptImages(model, images, tokens)
    ours, _ = prefill(model, reader, tokens, len(tokens))
    with torch.no_grad():
        expected = hf(**hf_inputs(tokens, pictures, model)).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)
    assert reader.shift == int(hf.model.rope_deltas[0, 0]) < 0  # transformers' rope_deltas
    # the same prompt read as text: the image's features and positions change everything
    text = np.array(model(mx.array([tokens]), model.make_caches()))
    assert np.abs(text - expected).max() > 1e-2


@BOTH
def test_decode_after_an_image_matches_transformers(kind: str, tiny: TinyModels) -> None:
    """A prompt with an image prefilled in chunks that cut it, then decode steps (each
    rotated at its offset plus the image's shift) give transformers' logits of the whole
    sequence."""
    hf, model = vision_model(tiny, kind)
    pictures = [_pixels(13, 24, 32)]  # 3 x 4 tokens: what follows sits 8 positions back
    tokens, images = prompt(pictures, [[5, 17, 40], [9, 8, 7]])
    follow = [21, 300, 4, 77, 512]
    reader = PromptImages(model, images, tokens)
    caches = model.make_caches()
    ours, ends = prefill(model, reader, tokens, 4, caches)
    assert any(i.start < e < i.end for i in images for e in ends)
    for token in follow:
        hidden = model.forward_shifted(mx.array([[token]]), caches, reader.shift)
        ours = np.concatenate([ours, np.array(model.logits(hidden))], axis=1)
    with torch.no_grad():
        expected = hf(**hf_inputs([*tokens, *follow], pictures, model)).logits.numpy()
    assert reader.shift == -8 and ours.shape == expected.shape
    np.testing.assert_allclose(ours, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 11])
def test_prefill_chunks_may_cut_images(chunk: int, tiny: TinyModels) -> None:
    _, model = vision_model(tiny)
    pictures = [_pixels(4, 24, 16), _pixels(5, 16, 24)]
    tokens, images = prompt(pictures, [[5, 17], [9, 8, 7], [33, 2, 1]])
    reader = PromptImages(model, images, tokens)
    whole, _ = prefill(model, reader, tokens, len(tokens))
    chunked, ends = prefill(model, reader, tokens, chunk)
    if chunk < 6:  # attention is causal inside images: chunks end where they would
        assert any(i.start < e < i.end for i in images for e in ends)
    np.testing.assert_allclose(chunked, whole, atol=ATOL, rtol=0)


def test_prompt_images_are_checked_against_the_prompt(tiny: TinyModels) -> None:
    _, model = vision_model(tiny)
    pixels = _pixels(6, 16, 24)
    tokens, images = prompt([pixels], [[5], [6]])
    PromptImages(model, images, tokens)
    image = images[0]
    odd = _pixels(6, 12, 24)  # 12 pixels is not a whole number of 8-pixel tokens
    bad = [
        (PromptImage(image.pixels, image.shape, image.digest, image.start, 5), "image 6"),
        (PromptImage(odd.tobytes(), odd.shape, digest(odd), image.start, 3), "multiples of 8"),
    ]
    for wrong, words in bad:
        with pytest.raises(ValueError, match=words):
            PromptImages(model, [wrong], tokens)


# -- preprocessing and placeholders ---------------------------------------------------


def _sample_images() -> list[Image.Image]:
    rng = np.random.default_rng(5)

    def noise(*shape: int) -> Any:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    palette = Image.fromarray(noise(64, 48, 3), "RGB").convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 3
    return [
        Image.fromarray(noise(37, 91, 4), "RGBA"),
        Image.fromarray(noise(120, 40), "L"),  # tall
        Image.fromarray(noise(30, 30, 2), "LA"),
        palette,
        Image.fromarray(noise(80, 100, 4), "CMYK"),
        Image.fromarray(noise(9, 13, 3), "RGB"),  # under min_pixels: scaled up
        Image.fromarray(noise(300, 200, 3), "RGB"),  # over max_pixels: scaled down
        Image.fromarray(noise(32, 64, 3), "RGB"),  # already on the grid
    ]


@pytest.mark.parametrize(("patch", "low", "high"), [(PATCH, 256, 4096), (16, 65536, 16777216)])
def test_preprocessing_equals_the_processor(
    patch: int, low: int, high: int, tmp_path: Path
) -> None:
    """Qwen2VLImageProcessor (PIL; the second bounds are Qwen3.5's published ones): the
    resized, normalised pixels cut into patches are its pixel_values, the grid its
    image_grid_thw."""
    write_preprocessor_config(tmp_path, low, high, patch)
    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    grid = GridResize(patch, MERGE, 2)
    prep = Preprocessing.read(tmp_path, 0, grid)
    assert prep.grid == GridResize(patch, MERGE, 2, low, high) and prep.resample == 3
    vision = _model_vision_args(patch)
    for image in _sample_images():
        expected = processor(images=image, return_tensors="np")
        ours = preprocess(image, prep)
        assert ours.dtype == np.float32 and ours.shape[0] == 3
        t, rows, cols = (int(x) for x in expected["image_grid_thw"][0])
        assert (t, rows, cols) == (1, ours.shape[1] // patch, ours.shape[2] // patch)
        patches = np.array(patchify(mx.array(ours[None]), vision))[0]
        np.testing.assert_allclose(patches, expected["pixel_values"], atol=1e-6, rtol=0)
        assert prep.grid is not None
        assert prep.grid.tokens(ours.shape) == t * rows * cols // MERGE**2


def _model_vision_args(patch: int) -> Any:
    from runtime.models.qwen3_vision import VisionArgs

    return VisionArgs(patch_size=patch, spatial_merge_size=MERGE)


def test_extreme_aspect_ratios_are_refused() -> None:
    data = io.BytesIO()
    Image.fromarray(np.zeros((1, 300, 3), np.uint8)).save(data, format="PNG")
    prep = Preprocessing(0, 0, grid=GridResize(PATCH, MERGE))
    with pytest.raises(ValueError, match="200-fold"):
        prepare_image(data.getvalue(), prep, ImageLimits())


def test_placeholders_follow_each_images_size(tiny: TinyModels) -> None:
    """The template's <|image_pad|> becomes one per image token (Qwen3VLProcessor's
    replace_image_token), each image placed on its own span."""
    directory = tiny["qwen3_5"][1]
    loaded = load(directory)
    spec = loaded.vision
    assert spec is not None and spec.marker == "<|image_pad|>"
    assert spec.preprocessing.grid == GridResize(PATCH, MERGE, 2, 256, 4096)
    prepared = []
    for size in ((16, 40), (32, 16)):
        data = io.BytesIO()
        Image.fromarray(np.full((*size, 3), 7, np.uint8)).save(data, format="PNG")
        prepared.append(prepare_image(data.getvalue(), spec.preprocessing, ImageLimits()))
    lengths = [spec.tokens(p.shape) for p in prepared]
    assert lengths == [2 * 5, 4 * 2]  # 16 x 40 pixels, 32 x 16
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    text = expand_markers(f"w5 {slot} w6 {slot} w7", spec, 2, "messages", lengths)
    assert text.count("<|image_pad|>") == sum(lengths)
    tokens = loaded.tokenizer.encode_prompt(text)
    images = place_images(spec, prepared, tokens, "messages")
    assert [i.length for i in images] == lengths
    for i in images:
        assert tokens[i.start - 1] == START and tokens[i.end] == END
        assert set(tokens[i.start : i.end]) == {IMAGE}
    model: Any = loaded.model
    PromptImages(model, images, tokens)  # the model agrees


# -- the engine ------------------------------------------------------------------------


class _Counting:
    """Counts the images a model's vision encoder sees."""

    def __init__(self, model: Any) -> None:
        self.images = 0
        self._encode = model.encode_images

    def __call__(self, pixels: mx.array) -> mx.array:
        self.images += int(pixels.shape[0])
        out: mx.array = self._encode(pixels)
        return out


class _Served(NamedTuple):
    engine: Engine
    model: Any  # the same checkpoint loaded apart: the reference
    counter: _Counting
    hf: Any  # transformers' model


@pytest.fixture(scope="module", params=list(KINDS))
def engine(request: pytest.FixtureRequest, tiny: TinyModels) -> Iterator[_Served]:
    """The engine (prefill chunks of 5 tokens, shorter than an image's span; two rows
    batched) for each kind, the same model loaded apart as the reference, and a count of
    the images the engine's encoder saw."""
    hf, directory = tiny[request.param]
    loaded = load(directory, dtype="float32")
    assert loaded.eos_token_ids == {EOS}
    model: Any = loaded.model
    counter = _Counting(model)
    model.encode_images = counter
    settings = RunnerSettings(
        prefill_chunk=5, prefix_cache_bytes=1 << 28, max_batch=2, snapshot_interval=8
    )
    eng = Engine(ModelRunner(loaded, settings))
    eng.start()
    yield _Served(eng, load_mlx(directory), counter, hf)
    eng.stop()


def _request(tokens: Sequence[int], images: Sequence[PromptImage], n: int) -> GenerationRequest:
    return GenerationRequest(
        tuple(tokens), n, SamplingParams(temperature=0.0), images=tuple(images)
    )


def _collect(events: Any) -> tuple[list[int], int]:
    out: list[int] = []
    done = None
    for event in events:
        if isinstance(event, TextDelta):
            out += event.token_ids
        else:
            done = event
    assert isinstance(done, Finished) and done.error is None, done
    return out, done.stats.cached_tokens


def _generate(eng: Engine, tokens: Sequence[int], images: Sequence[PromptImage], n: int = 6) -> Any:
    return _collect(eng.submit(_request(tokens, images, n)))


def _greedy(model: Any, tokens: Sequence[int], images: Sequence[PromptImage], n: int) -> Any:
    """The reference: one-shot prefill, then greedy decoding (to EOS), caches fresh."""
    caches = model.make_caches()
    reader = PromptImages(model, images, tokens)
    reader.forward(tokens[:-1], caches, 0)
    out, last = [], tokens[-1]
    for _ in range(n):
        hidden = model.forward_shifted(mx.array([[last]]), caches, reader.shift)
        last = int(np.argmax(np.array(model.logits(hidden)[0, -1])))
        out.append(last)
        if last == EOS:
            break
    return out


def _to_eos(tokens: Iterable[int]) -> list[int]:
    out = list(tokens)
    return out[: out.index(EOS) + 1] if EOS in out else out


def test_greedy_after_an_image_equals_transformers(engine: _Served) -> None:
    eng, model, _, hf = engine
    pictures = [_pixels(7, 24, 40)]
    tokens, images = prompt(pictures, [[5, 6, 7], [8, 9, 10, 11]])
    got, _ = _generate(eng, tokens, images, 8)
    with torch.no_grad():
        out = hf.generate(**hf_inputs(tokens, pictures, model), max_new_tokens=8, do_sample=False)
    assert got == _to_eos(int(t) for t in out[0, len(tokens) :])
    assert got == _greedy(model, tokens, images, 8)


def test_prefix_cache_keys_images_by_content(engine: _Served) -> None:
    eng, model, counter, _ = engine
    x, y = _pixels(8, 16, 24), _pixels(9, 16, 24)
    texts = [[20, 21, 22, 23, 24], [25, 26, 27, 28, 29, 30, 31]]
    tokens, with_x = prompt([x], texts)
    _, with_y = prompt([y], texts)
    span = with_x[0]
    first, _ = _generate(eng, tokens, with_x)
    assert first == _greedy(model, tokens, with_x, 6)
    encoded = counter.images
    again, cached = _generate(eng, tokens, with_x)
    assert again == first and cached > span.end  # the image's span came from the cache
    assert counter.images == encoded  # and its encoder did not run again
    other, cached = _generate(eng, tokens, with_y)
    assert cached <= span.start  # another image never reuses the first one's state
    assert other == _greedy(model, tokens, with_y, 6) and counter.images == encoded + 1
    # the next turn goes on from the cached answer: its positions are the prompt's too
    turn = [*tokens, *first, 40, 41, 42]
    second, cached = _generate(eng, turn, with_x)
    assert cached > span.end
    assert second == _greedy(model, turn, with_x, 6)


@BOTH
def test_a_new_question_about_the_same_image_reuses_it(kind: str, tiny: TinyModels) -> None:
    """The recurrent layers get a snapshot where an image's span ends (and at message
    starts), as a text prompt's do at message starts; no snapshot interval falls in
    the prompt, and the points inside a chunk cost no forward of their own."""
    loaded = load(tiny[kind][1], dtype="float32")
    model: Any = loaded.model
    placed = model.forward_placed
    chunks: list[int] = []

    def counting(tokens: mx.array, *args: Any) -> mx.array:
        chunks.append(int(tokens.shape[1]))
        out: mx.array = placed(tokens, *args)
        return out

    model.forward_placed = counting
    eng = Engine(ModelRunner(loaded, RunnerSettings(prefix_cache_bytes=1 << 28)))
    eng.start()
    reference = load_mlx(tiny[kind][1])
    x = _pixels(8, 16, 24)
    try:
        # reused: nothing; the image's span (not its <|vision_end|>, nor the question);
        # up to where the second request left the first one (a branch point)
        for question, reused in (([25, 26, 27], 0), ([40, 41], 10), ([42], 11)):
            tokens, images = prompt([x], [[990, 20, 21], [*question, 991, 990, 30]])
            starts = tuple(i for i, t in enumerate(tokens) if i and t == 990)
            request = GenerationRequest(
                tuple(tokens), 6, SamplingParams(temperature=0.0), images=tuple(images),
                boundaries=starts,
            )  # fmt: skip
            chunks.clear()
            got, cached = _collect(eng.submit(request))
            assert len(chunks) == 1  # one forward, whatever the points inside
            assert images[0].end == 10 and cached == reused
            assert got == _greedy(reference, tokens, images, 6)
    finally:
        eng.stop()


def test_an_image_request_batched_with_a_text_request(engine: _Served) -> None:
    eng, model, _, _ = engine
    # a 5 x 5 image: what follows sits 20 positions before its offset
    tokens, images = prompt([_pixels(10, 40, 40)], [[50, 51], [52, 53, 54]])
    text = [int(t) for t in np.random.default_rng(3).integers(3, 900, 12)]
    alone = [_greedy(model, tokens, images, 10), _greedy(model, text, [], 24)]
    requests = [_request(tokens, images, 10), _request(text, [], 24)]
    results: list[Any] = [None, None]

    def client(i: int) -> None:
        results[i] = _collect(eng.submit(requests[i]))

    threads = [threading.Thread(target=client, args=(i,)) for i in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    runner = eng._runner
    assert isinstance(runner, ModelRunner) and runner.scheduler.stats.max_batch_seen == 2
    assert [r[0] for r in results] == alone


# -- through the server ---------------------------------------------------------------


@pytest.fixture(scope="module", params=list(KINDS))
def server(request: pytest.FixtureRequest, tiny: TinyModels) -> Iterator[tuple[str, str]]:
    """The gateway serving each kind: its base URL and model id."""
    directory = tiny[request.param][1]
    model_id = f"tiny-{request.param}-vision"
    with live_server(lambda: build_served(directory, model_id=model_id)) as url:
        yield url, model_id


def test_a_chat_image_counts_its_grid_of_tokens(server: tuple[str, str]) -> None:
    """The server reads images for the model (as its card says), each its grid of tokens."""
    base_url, model_id = server
    data = io.BytesIO()
    Image.fromarray(np.full((40, 24, 3), 200, np.uint8)).save(data, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(data.getvalue()).decode()
    image = {"type": "image_url", "image_url": {"url": url}}
    text = {"type": "text", "text": "w5 w6"}

    def chat(content: list[dict[str, Any]]) -> Any:
        messages = [{"role": "user", "content": content}]
        body = {"model": model_id, "messages": messages}
        return post(base_url, "/v1/chat/completions", {"max_tokens": 3, "temperature": 0, **body})

    with_image, without = chat([image, text]), chat([text])
    assert with_image.status_code == 200, with_image.text
    used = with_image.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"]
    assert used == 1 + 5 * 3 + 1  # <|vision_start|>, 40 x 24 pixels as 5 x 3 tokens, end
    body = {"model": model_id, "messages": [{"role": "user", "content": [image, text]}]}
    counted = post(base_url, "/tokenize", body).json()
    assert counted["count"] == with_image.json()["usage"]["prompt_tokens"]
    card = httpx.get(f"{base_url}/v1/models/{model_id}", timeout=30).json()
    assert card["capabilities"]["vision"] is True
