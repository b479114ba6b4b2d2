"""The measuring processes of bench/quantized.py (one per measurement, so that each peak RSS
is its own), and the MLX 4-bit export of a GGUF. Each prints one JSON line last.

    python bench/_quantized_workers.py KIND PATH VOCAB PROMPT GEN STREAMS THREADS TAIL
    python bench/_quantized_workers.py export GGUF FOLDER
KIND: gateway | llama.cpp | mlx-lm. STREAMS > 1: that many requests at once. TAIL: the
prompt tokens mlx-lm prefills itself (see run_mlxlm).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIN_AVAILABLE_BYTES = 1 << 30  # below this the worker ends itself rather than wake the OOM killer
WARMUP_PROMPT, WARMUP_GEN = 32, 8


# ---------------------------------------------------------------- shared
def one_line(text: str) -> str:
    """An error fit for a table cell."""
    text = " ".join(text.split()).replace("|", "/")
    return text if len(text) <= 300 else text[:140] + " ... " + text[-155:]


def prompt_ids(vocab: int, n: int) -> list[int]:
    # as bench/decode.py: deterministic, spread over the vocabulary, no special ids at the ends
    return [(1009 * i + 7) % (vocab - 512) + 256 for i in range(n)]


def prompt(vocab: int, n: int, stream: int) -> list[int]:
    """The measured prompt of a stream: a first token of its own (no stream, nor the warm-up,
    shares a prefix with another), then the common ids."""
    return [prompt_ids(vocab, 1 + stream)[-1] + 1, *prompt_ids(vocab, n - 1)]


def warmup_prompt(vocab: int) -> list[int]:
    return prompt_ids(vocab, WARMUP_PROMPT)[::-1]


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_gb(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    match = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(match.group(1)) * 1024 / 1e9 if match else float("nan")


def peak_rss_gb() -> float:
    return _status_gb("VmHWM")


def rss_split() -> dict[str, float]:
    """The resident memory now, anonymous and file-backed (a mapped model file's pages are
    page cache, shared and reclaimable; VmHWM counts them too)."""
    return {"rss_anon_gb": _status_gb("RssAnon"), "rss_file_gb": _status_gb("RssFile")}


def _guard_memory() -> None:
    """A thread that ends the process when the machine runs out of memory (the 7B shape
    dequantized to float32 does not fit: better a failed cell than a killed neighbour)."""

    def watch() -> None:
        while True:
            info = Path("/proc/meminfo").read_text()
            match = re.search(r"MemAvailable:\s+(\d+) kB", info)
            if match and int(match.group(1)) * 1024 < MIN_AVAILABLE_BYTES:
                print(
                    f"out of memory: MemAvailable under {MIN_AVAILABLE_BYTES >> 20} MiB at "
                    f"RSS peak {peak_rss_gb():.1f} GB",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(3)
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def aggregate(times: Sequence[Sequence[float]]) -> dict[str, Any]:
    """Streams' token timestamps -> decode tok/s over the window where all of them decode."""
    firsts = [ts[0] for ts in times if ts]
    if len(firsts) < len(times):
        return {"aggregate_tps": None, "note": "a stream made no token"}
    start, end = max(firsts), min(ts[-1] for ts in times)
    tokens = sum(1 for ts in times for t in ts if start < t <= end)
    total = sum(len(ts) for ts in times)
    wall = max(ts[-1] for ts in times) - min(firsts)
    return {
        "aggregate_tps": tokens / (end - start) if end > start else None,
        "window_s": end - start,
        "window_tokens": tokens,
        "overall_tps": total / wall if wall > 0 else None,
    }


# ---------------------------------------------------------------- gateway
def run_gateway(path: Path, vocab: int, n: int, gen: int, streams: int) -> dict[str, Any]:
    from dataclasses import replace

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runtime.engine import Engine, ModelRunner, RunnerSettings
    from runtime.load import load
    from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta

    loaded = load(path)
    flat: list[tuple[str, mx.array]] = tree_flatten(loaded.model.parameters())  # type: ignore[assignment]
    info: dict[str, Any] = {
        "load_s": loaded.load_seconds,
        "quantized": loaded.quantized,
        "dtype": loaded.dtype,
        "weights_gb": sum(v.nbytes for _, v in flat) / 1e9,
    }
    loaded = replace(loaded, eos_token_ids=frozenset())  # always generate gen tokens
    # speculative decoding off: llama.cpp here decodes one token a step too (its prompt
    # lookup is measured against ours in bench/speculative.py); the bench's repeating
    # random-token outputs would otherwise be drafted, and decode tok/s would measure that
    engine = Engine(ModelRunner(loaded, RunnerSettings(speculative="off")))
    engine.start()
    greedy = SamplingParams(temperature=0.0)
    list(engine.submit(GenerationRequest(tuple(warmup_prompt(vocab)), WARMUP_GEN, greedy)))
    requests = [GenerationRequest(tuple(prompt(vocab, n, i)), gen, greedy) for i in range(streams)]
    if streams > 1:
        # prefill the prompts first (one token each), so that the measured requests find
        # them in the prefix cache and all decode at once, as mlx-lm's batch does: the
        # engine admits a prompt while the others decode, which would stagger the streams
        for request in requests:
            list(engine.submit(replace(request, max_tokens=1)))
    info["peak_reset"] = reset_peak()
    handles = engine.submit_all(requests)
    times: list[list[float]] = [[] for _ in handles]
    ids: list[list[int]] = [[] for _ in handles]
    finished: list[Any] = [None] * len(handles)

    def consume(i: int) -> None:
        for event in handles[i]:
            if isinstance(event, TextDelta) and event.token_ids:
                times[i].append(time.perf_counter())
                ids[i].extend(event.token_ids)
            elif isinstance(event, Finished):
                finished[i] = event

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(handles))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info["peak_rss_gb"] = peak_rss_gb()
    info |= rss_split()
    engine.stop()
    for done in finished:
        if not isinstance(done, Finished) or done.error:
            raise RuntimeError(f"a request ended badly: {done}")
    stats = finished[0].stats
    info["tokens"] = ids[0][:32]
    if streams > 1:
        info["cached_tokens"] = [f.stats.cached_tokens for f in finished]
        return info | aggregate(times)
    return info | {
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
        "cached_tokens": stats.cached_tokens,
    }


# ---------------------------------------------------------------- llama.cpp
def run_llama(path: Path, vocab: int, n: int, gen: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(
        model_path=str(path),
        n_ctx=n + gen + 64,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    info: dict[str, Any] = {"load_s": time.perf_counter() - start}

    def greedy(tokens: list[int], count: int, stamps: list[float]) -> list[int]:
        out: list[int] = []
        gen_iter = llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
        for token in gen_iter:
            stamps.append(time.perf_counter())
            out.append(int(token))
            if len(out) >= count:
                break
        return out

    greedy(warmup_prompt(vocab), WARMUP_GEN, [])
    info["peak_reset"] = reset_peak()
    stamps: list[float] = []
    begin = time.perf_counter()
    out = greedy(prompt(vocab, n, 0), gen, stamps)
    info["peak_rss_gb"] = peak_rss_gb()
    info |= rss_split()
    info["tokens"] = out[:32]
    info["prefill_tps"] = n / (stamps[0] - begin)
    info["decode_tps"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return info


# ---------------------------------------------------------------- mlx-lm
def _filled_caches(folder: Path, prompts: list[list[int]], dtype: Any) -> list[Any]:
    """KV caches holding the prompts, computed by a float32 copy of the model (dequantized
    from the same 4-bit weights, run by the BLAS), in the quantized model's dtype: mlx-lm's
    quantized CPU prefill runs at about its decode speed, a 512-token context would take it
    minutes per stream on the small models and hours on the 7B shape. The caches hold the
    same shapes, so the decode that follows costs what it would after its own prefill."""
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import dequantize_model, load_model

    plain, _ = load_model(folder)
    plain = dequantize_model(plain)
    plain.set_dtype(mx.float32)
    caches = []
    for ids in prompts:
        cache = make_prompt_cache(plain)
        for at in range(0, len(ids), 512):
            plain(mx.array([ids[at : at + 512]]), cache=cache)
            mx.eval([c.state for c in cache])
        for c in cache:
            c.keys, c.values = c.keys.astype(dtype), c.values.astype(dtype)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    del plain
    gc.collect()
    mx.clear_cache()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the copy's freed heap back: RSS is measured
    return caches


def run_mlxlm(
    folder: Path, vocab: int, n: int, gen: int, streams: int, tail: int
) -> dict[str, Any]:
    """``tail``: the prompt's last tokens mlx-lm prefills itself (the one-stream prefill
    rate is theirs); the rest fill the caches by _filled_caches. Streams: all but the last
    token filled so, then mlx-lm's BatchGenerator decodes them together."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.generate import BatchGenerator, generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    start = time.perf_counter()
    model, _ = load_model(folder)
    info: dict[str, Any] = {"load_s": time.perf_counter() - start}
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    dtype = next(v.dtype for k, v in flat if k.endswith(".scales"))
    # a short warm-up: each token costs mlx-lm as much here as in the measurement
    for _ in generate_step(mx.array(warmup_prompt(vocab)[:4]), model, max_tokens=2):
        pass
    prompts = [prompt(vocab, n, i) for i in range(streams)]
    tail = min(tail, n) if streams == 1 else 1
    info["mlxlm_prefilled_tokens"] = tail
    filled = [p[:-tail] for p in prompts]
    caches = (
        _filled_caches(folder, filled, dtype)
        if tail < n
        else [make_prompt_cache(model) for _ in prompts]
    )
    info["peak_reset"] = reset_peak()
    if streams == 1:
        stamps: list[float] = []
        tokens: list[int] = []
        begin = time.perf_counter()
        ids = mx.array(prompts[0][-tail:])
        for tok, _ in generate_step(ids, model, max_tokens=gen, prompt_cache=caches[0]):
            tokens.append(int(tok))
            stamps.append(time.perf_counter())
        info["peak_rss_gb"] = peak_rss_gb()
        info |= rss_split()
        info["tokens"] = tokens[:32]
        info["prefill_tps"] = tail / (stamps[0] - begin)
        info["decode_tps"] = (len(stamps) - 1) / (stamps[-1] - stamps[0])
        return info
    batch = BatchGenerator(
        model, max_tokens=gen, completion_batch_size=streams, prefill_batch_size=streams
    )
    uids = batch.insert([p[-1:] for p in prompts], [gen] * streams, caches=caches)
    times: dict[int, list[float]] = {uid: [] for uid in uids}
    done = 0
    while done < streams:
        prompt_responses, responses = batch.next()
        now = time.perf_counter()
        if not prompt_responses and not responses:
            raise RuntimeError("mlx-lm's BatchGenerator stopped before every stream finished")
        for r in responses:
            times[r.uid].append(now)
            done += r.finish_reason is not None
    info["peak_rss_gb"] = peak_rss_gb()
    info |= rss_split()
    batch.close()
    return info | aggregate([times[u] for u in uids])


def export_mlx4(gguf: Path, folder: Path) -> dict[str, Any]:
    """Our loader's float weights of a GGUF, quantized as `mlx_lm.convert -q` does
    (bfloat16, then 4 bits in groups of 64), with the GGUF's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    from bench._random_7b import write_tokenizer
    from runtime.load import load

    loaded = load(gguf, keep_quantized=False)
    flat: list[tuple[str, mx.array]] = tree_flatten(loaded.model.parameters())  # type: ignore[assignment]
    plain = folder.with_name(folder.name + ".bf16.part")
    plain.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(
        str(plain / "model.safetensors"),
        {k: v.astype(mx.bfloat16) for k, v in flat},
        metadata={"format": "mlx"},
    )
    config = dict(loaded.config) | {"torch_dtype": "bfloat16"}
    (plain / "config.json").write_text(json.dumps(config, indent=1))
    del loaded, flat
    model, config = load_model(plain)
    model, config = quantize_model(model, config, 64, 4)
    tmp = folder.with_name(folder.name + ".part")
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    write_tokenizer(tmp, gguf)
    tmp.rename(folder)
    shutil.rmtree(plain)
    return {"folder": str(folder)}


# ---------------------------------------------------------------- entry
def main(argv: list[str]) -> None:
    kind = argv[0]
    _guard_memory()
    if kind != "llama.cpp":
        from runtime import backend

        backend.configure()  # before MLX loads (runtime/backend.py)
    if kind == "export":
        print(json.dumps(export_mlx4(Path(argv[1]), Path(argv[2]))))
        return
    path = Path(argv[1])
    vocab, n, gen, streams, threads, tail = (int(a) for a in argv[2:8])
    runs: dict[str, Callable[[], dict[str, Any]]] = {
        "gateway": lambda: run_gateway(path, vocab, n, gen, streams),
        "llama.cpp": lambda: run_llama(path, vocab, n, gen, threads),
        "mlx-lm": lambda: run_mlxlm(path, vocab, n, gen, streams, tail),
    }
    load_before = os.getloadavg()[0]
    result = runs[kind]()
    # the machine is shared: a 1-minute load average well over the threads used means the
    # numbers were measured on a busy machine
    loads = {"load_before": load_before, "load_after": os.getloadavg()[0]}
    print(json.dumps(result | loads | {"prompt_tokens": n, "gen_tokens": gen, "streams": streams}))


if __name__ == "__main__":
    main(sys.argv[1:])
