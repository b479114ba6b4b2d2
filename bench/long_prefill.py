"""Long-prompt prefill of the gateway against llama.cpp, side by side in one run.

Agents open every session with one long prompt. For each prompt (see bench/_long_prompts.py:
the OpenClaw, Codex and Claude Code first requests rendered by the gateway's own adapters
and the model's chat template, and synthetic code prompts of a given token count, with
512 tokens as the reference), the same token ids go to:
  gateway    runtime.load.loader + the server's engine (build_served), prefix cache off, one
             request at a time: float32 weights, optimized BLAS, the server's chunking
  llama.cpp  llama-cpp-python on the same GGUF (its native quantized kernels),
             `Llama.eval(ids)`, --llama-threads threads, --llama-batch batch
Each engine runs each prompt in a fresh subprocess, one after the other: no shared memory
or BLAS threads, and the peak memory is that process's own. Timed: time to first token
(prompt in, first greedy token out; both warmed up on a short prompt first), prefill
tokens/s, decode tokens/s over the next --gen-tokens tokens (EOS ignored), peak memory (the
gateway: MLX's peak and the RSS high-water mark; llama.cpp: RSS high-water mark; the mark
is reset after loading, so it is the request's).

Targets (issue 9): gateway TTFT <= 1.0x llama.cpp's for every prompt from 8k tokens up;
gateway prefill tokens/s at 32k >= 0.5x its own at 512; peak memory at 32k within 1.5x of
weights + KV cache.

    python bench/long_prefill.py [--lengths 512,4k,openclaw,codex,16k,claude,32k]
        [--skip-llama] [--gateway-only-env MLX_GATEWAY_CPU_ATTENTION=0 ...] [--json out.json]

--gateway-only-env KEY=VAL[,KEY=VAL] sets variables for the gateway's process only; given
several times, the gateway runs once per value (e.g. `=0` and `=1` to compare a switch).
The gateway's process reads MLX_GATEWAY_PREFILL_CHUNK and MLX_GATEWAY_PREFIX_CACHE_BYTES as
`mlx-gateway serve` does (default here: 0, cache off; `=4G` measures the memory of the
cache's snapshots too; the cache starts empty, so nothing is reused).
On this 2-core CPU the whole default table takes hours: start with `--lengths 512,2k`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._long_prompts import (  # noqa: E402
    DEFAULT,
    fixtures_folder,
    parse_names,
    render_prompts,
)

MODEL = "qwen2.5-coder-0.5b"
TIMEOUT_S = 6 * 3600.0
WARM_UP_TOKENS = 256
IDLE_CORES = 0.2  # --wait-idle: what counts as nearly idle
GB = 1e9


# ---------------------------------------------------------------- memory of this process
def _hwm_bytes() -> int:
    """This process's RSS high-water mark."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        import resource

        scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale
    m = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(m.group(1)) * 1024 if m else 0


def _reset_hwm() -> bool:
    """Start the high-water mark over from the current RSS (Linux), so loading's peak
    is not counted as the request's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _cpu_mark() -> tuple[float, float, float]:
    """(wall, CPU seconds busy on the whole machine, CPU seconds of this process)."""
    busy = 0.0
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(f) for f in fields]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # - idle, iowait
    except (OSError, ValueError, IndexError):
        pass
    return time.perf_counter(), busy, time.process_time()


def _others(before: tuple[float, float, float]) -> float:
    """Cores other processes kept busy since `before`, on average: the noise in a timing
    on a shared machine (0 when /proc/stat is not there)."""
    after = _cpu_mark()
    wall = after[0] - before[0]
    if not before[1] or wall <= 0:
        return 0.0
    return max((after[1] - before[1]) - (after[2] - before[2]), 0.0) / wall


# ---------------------------------------------------------------- workers (subprocesses)
def _warm_up_ids(ids: list[int]) -> list[int]:
    """A short prompt that shares no prefix with `ids` (nothing to reuse even with the
    prefix cache on), long enough to run the prefill code paths once."""
    warm = ids[:WARM_UP_TOKENS][::-1]
    return warm[1:] if warm and warm[0] == ids[0] else warm


def worker_render(gguf: Path, names: list[str], gen: int, fixtures: Path) -> dict[str, Any]:
    from gateway.core.models import build_served
    from gateway.core.settings import EngineSettings

    served = build_served(gguf, model_id=MODEL, settings=EngineSettings(prefix_cache_bytes=0))
    return {
        "prompts": render_prompts(served, names, gen, fixtures),
        "context_length": served.context_length,
    }


def _model_bytes(loaded: Any, tokens: int) -> tuple[int, int]:
    """(weights, KV cache of `tokens` tokens) in bytes, as the runtime holds them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: list[tuple[str, mx.array]] = tree_flatten(loaded.model.parameters())  # type: ignore[assignment]
    weights = sum(v.nbytes for _, v in flat)
    cfg = loaded.config
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * getattr(mx, loaded.dtype).size
    return int(weights), int(per_token * tokens)


def _prefill_flops(loaded: Any, tokens: int) -> float:
    """The arithmetic of a `tokens`-token prefill: 2 flops per weight of the decoder
    layers per token, and the attention's two products over the causal triangle
    (4 flops x layers x query heads x head size for each (query, key) pair). The
    embedding lookup, norms, softmax and the last token's logits are left out."""
    from mlx.utils import tree_flatten

    flat: list[tuple[str, Any]] = tree_flatten(loaded.model.parameters())  # type: ignore[assignment]
    layer_weights = sum(v.size for k, v in flat if ".layers." in f".{k}" and v.ndim >= 2)
    cfg = loaded.config
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    pairs = tokens * (tokens + 1) / 2
    return 2.0 * layer_weights * tokens + 4.0 * cfg["num_hidden_layers"] * heads * head_dim * pairs


def _engine_settings() -> Any:
    """The server's settings, cache off unless this process's environment says otherwise
    (the variables `mlx-gateway serve` reads, e.g. through --gateway-only-env)."""
    from gateway.cli.common import parse_bytes
    from gateway.core.settings import EngineSettings

    env = os.environ
    return EngineSettings(
        prefill_chunk=int(env.get("MLX_GATEWAY_PREFILL_CHUNK", EngineSettings.prefill_chunk)),
        prefix_cache_bytes=parse_bytes(env.get("MLX_GATEWAY_PREFIX_CACHE_BYTES", "0")),
    )


def worker_gateway(gguf: Path, ids: list[int], gen: int) -> dict[str, Any]:
    import dataclasses

    import mlx.core as mx

    from gateway.core.models import build_served
    from runtime.load import load
    from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta

    # EOS ignored: every run decodes the same number of tokens
    loaded = dataclasses.replace(load(gguf), eos_token_ids=frozenset())
    settings = _engine_settings()
    engine = build_served(gguf, model_id=MODEL, settings=settings, loaded=loaded).engine
    engine.start()
    greedy = SamplingParams(temperature=0.0)
    try:
        list(engine.submit(GenerationRequest(tuple(_warm_up_ids(ids)), 2, greedy)))
        hwm_reset = _reset_hwm()
        mx.reset_peak_memory()
        generated: list[int] = []
        first = done = None
        mark = _cpu_mark()
        start = time.perf_counter()
        for event in engine.submit(GenerationRequest(tuple(ids), gen, greedy)):
            if isinstance(event, TextDelta) and event.token_ids:
                first = first or time.perf_counter()
                generated += event.token_ids
            elif isinstance(event, Finished):
                done = event
        end = time.perf_counter()
        others = _others(mark)
    finally:
        engine.stop()
    if not isinstance(done, Finished) or first is None or done.error:
        raise RuntimeError(f"the request did not finish: {done}")
    if done.stats.cached_tokens:
        raise RuntimeError(f"{done.stats.cached_tokens} tokens came from the prefix cache")
    weights, kv = _model_bytes(loaded, len(ids) + gen)
    return {
        **_timings(len(ids), generated, start, first, end),
        "others_cores": others,
        "peak_mlx_bytes": int(mx.get_peak_memory()),
        "peak_rss_bytes": _hwm_bytes(),
        "hwm_reset": hwm_reset,
        "weights_bytes": weights,
        "kv_bytes": kv,
        "prefill_flops": _prefill_flops(loaded, len(ids)),
        "dtype": loaded.dtype,
        "prefill_chunk": settings.prefill_chunk,
        "prefix_cache_bytes": settings.prefix_cache_bytes,
    }


def worker_llama(gguf: Path, ids: list[int], gen: int, opts: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=len(ids) + gen + 16,
        n_threads=opts["threads"],
        n_threads_batch=opts["threads"],
        n_batch=opts["batch"],
        n_ubatch=opts["batch"],
        flash_attn=opts["flash_attn"],
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def greedy() -> int:
        # the last evaluated position's logits (llama.cpp computes only that row)
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))

    llm.eval(_warm_up_ids(ids))  # then start over with an empty KV cache
    llm.reset()
    hwm_reset = _reset_hwm()
    mark = _cpu_mark()
    start = time.perf_counter()
    llm.eval(ids)
    generated = [greedy()]
    first = time.perf_counter()
    while len(generated) < gen:
        llm.eval(generated[-1:])
        generated.append(greedy())
    end = time.perf_counter()
    return {
        **_timings(len(ids), generated, start, first, end),
        "others_cores": _others(mark),
        "peak_rss_bytes": _hwm_bytes(),
        "hwm_reset": hwm_reset,
        "version": llama_cpp.__version__,
    }


def _timings(
    n_prompt: int, generated: list[int], start: float, first: float, end: float
) -> dict[str, Any]:
    decode_s = end - first
    return {
        "tokens": n_prompt,
        "ttft_s": first - start,
        "prefill_tps": n_prompt / (first - start),
        "decode_tps": (len(generated) - 1) / decode_s if decode_s > 0 else 0.0,
        "generated": generated,
    }


def _worker_main(kind: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    gguf = Path(spec["gguf"])
    if kind == "llama":
        result = worker_llama(gguf, spec["ids"], spec["gen"], spec["llama"])
    else:
        from runtime import backend

        backend.configure()  # the optimized BLAS, before MLX is imported
        if kind == "render":
            result = worker_render(gguf, spec["names"], spec["gen"], Path(spec["fixtures"]))
        else:
            result = worker_gateway(gguf, spec["ids"], spec["gen"])
    print(json.dumps(result), flush=True)
    # The result is out: skip the interpreter's teardown, where arrays (or threads) of
    # MLX left for the last garbage collection can abort the process ("terminate called
    # without an active exception") and lose a finished measurement.
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- driver
def _run_worker(
    kind: str, spec: dict[str, Any], env: dict[str, str], workdir: Path, timeout: float
) -> dict[str, Any]:
    """One worker in its own process; its stderr goes to the terminal as it runs."""
    spec_path = workdir / f"{kind}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, __file__, "--worker", kind, str(spec_path)]
    out = subprocess.run(
        cmd, env={**os.environ, **env}, stdout=subprocess.PIPE, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{kind} worker exited with {out.returncode}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _wait_idle(most_s: float) -> None:
    """Wait (up to `most_s`) until the other processes leave the CPUs nearly idle."""
    start = time.monotonic()
    said = start
    while time.monotonic() - start < most_s:
        mark = _cpu_mark()
        time.sleep(5.0)
        busy = _others(mark)
        if busy < IDLE_CORES:
            return
        if time.monotonic() - said >= 60:
            _say(f"  waiting: other processes keep {busy:.2f} cores busy")
            said = time.monotonic()
    _say(f"  not idle after {most_s:.0f} s; measuring anyway")


def _variants(values: Sequence[str]) -> list[tuple[str, dict[str, str]]]:
    """--gateway-only-env values -> (label, environment) per gateway run."""
    if not values:
        return [("gateway", {})]
    out = []
    for value in values:
        env = {}
        for pair in value.split(","):
            key, sep, val = pair.partition("=")
            if not sep or not key.strip():
                raise SystemExit(f"--gateway-only-env wants KEY=VAL[,KEY=VAL], not {value!r}")
            env[key.strip()] = val
        out.append((value, env))
    return out


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--lengths", default=",".join(DEFAULT), help="comma-separated prompt names")
    p.add_argument("--model", default=MODEL, help="store alias or GGUF path")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--gateway-only-env", action="append", default=[], metavar="KEY=VAL")
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--llama-batch", type=int, default=512, help="n_batch = n_ubatch")
    p.add_argument("--llama-flash-attn", action="store_true")
    p.add_argument("--fixtures", default=None, help="folder of the captured client requests")
    p.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per worker")
    p.add_argument(
        "--wait-idle", type=float, default=0.0, metavar="SECONDS",
        help="before each timing, wait up to this long for other processes to go quiet",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write every number here (after each prompt)")
    args = p.parse_args(argv)
    try:
        args.names = parse_names(args.lengths)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return args


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _measure(args: argparse.Namespace, gguf: Path, workdir: Path) -> dict[str, Any]:
    """Render, then every prompt on every engine; partial results are saved as they come."""
    _say(f"rendering {', '.join(args.names)} ...")
    base = {"gguf": str(gguf), "gen": args.gen_tokens}
    spec = {**base, "names": args.names, "fixtures": str(fixtures_folder(args.fixtures))}
    rendered = _run_worker("render", spec, {}, workdir, args.timeout)
    prompts: dict[str, list[int]] = rendered["prompts"]
    llama_opts = {
        "threads": args.llama_threads, "batch": args.llama_batch,
        "flash_attn": args.llama_flash_attn,
    }  # fmt: skip
    report: dict[str, Any] = {
        "model": str(gguf),
        "gen_tokens": args.gen_tokens,
        "llama": llama_opts,
        "prompts": {name: len(ids) for name, ids in prompts.items()},
        "runs": [],
    }
    runs = [(label, "gateway", env) for label, env in _variants(args.gateway_only_env)]
    runs += [] if args.skip_llama else [("llama.cpp", "llama", {})]
    for name, ids in prompts.items():
        for label, kind, env in runs:
            _say(f"{name} ({len(ids)} tokens): {label} ...")
            if args.wait_idle:
                _wait_idle(args.wait_idle)
            try:
                result = _run_worker(kind, {**base, "ids": ids, "llama": llama_opts}, env,
                                     workdir, args.timeout)  # fmt: skip
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                result = {"error": " ".join(str(exc).split())[:300], "tokens": len(ids)}
            _say(f"  {_brief(result)}")
            report["runs"].append({"prompt": name, "run": label, "env": env, **result})
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def _brief(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"FAILED: {r['error']}"
    return (
        f"TTFT {r['ttft_s']:.2f} s, prefill {r['prefill_tps']:.1f} tok/s, "
        f"decode {r['decode_tps']:.1f} tok/s, peak RSS {r['peak_rss_bytes'] / GB:.2f} GB, "
        f"other processes busy {r['others_cores']:.2f} cores"
    )


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker_main(argv[1], argv[2])
        return
    args = _args(argv)
    from bench._prefill_report import print_report
    from gateway.cli.store.store import Store

    gguf = Store().resolve(args.model) if not args.model.endswith(".gguf") else Path(args.model)
    with tempfile.TemporaryDirectory(prefix="long-prefill-") as tmp:
        report = _measure(args, gguf, Path(tmp))
    print_report(report)


if __name__ == "__main__":
    main()
