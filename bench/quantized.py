"""Quantized models on the CPU: the gateway against llama.cpp and mlx-lm (issue 26),
measured in the same run, each measurement in its own process.

Models: the real GGUFs (smollm2-135m Q4_1, gemma3-270m Q4_K_M, qwen2.5-coder-0.5b Q4_K_M)
and random weights at Qwen2.5-7B's shapes (bench/_random_7b.py: F16 GGUF -> Q4_K_M by
llama.cpp's quantizer, and an MLX 4-bit folder of the same weights). Configurations:

  gateway       runtime.load.load(<the GGUF>) with whatever precision policy the loader
                has, served by the Engine/ModelRunner (as bench/decode.py), default settings
  gateway-mlx4  the same on the MLX 4-bit folder (not run unless asked for)
  llama.cpp     llama_cpp.Llama on the same GGUF, --llama-threads threads, greedy
  mlx-lm        mlx-lm on an MLX 4-bit folder (group 64, bfloat16 scales) of the same weights:
                for a real GGUF our loader's dequantized weights quantized by
                mlx_lm.utils.quantize_model (what `mlx_lm.convert -q` does). Its quantized
                CPU prefill runs at about its decode speed (~1 tok/s on SmolLM2: a 512-token
                prompt takes it 8 minutes, 8 of them an hour, the 7B shape hours), so it
                prefills only the prompt's last --mlxlm-tail (32) tokens itself (its prefill
                rate is theirs), the context before them filled into its KV caches by a
                float32 copy dequantized from the same 4-bit weights; its decode then costs
                what it would after its own prefill. Its streams: all but the last token
                filled so. On the 7B shape no float copy fits: one stream after a
                --mlxlm-7b-prompt-tokens (32) prompt it prefills itself, no streams.

Measurements (same token ids everywhere; EOS ignored, so every run makes its tokens):
  one@512  one stream after a 512-token prompt: decode and prefill tok/s, peak RSS
  one@8k   the same after --long-tokens (8000: under SmolLM2's 8192 context with the
           generated tokens); gateway and llama.cpp, not on the 7B shape
  streams  --streams (8) requests of 512 tokens at once: aggregate decode tok/s over the
           window in which every stream is decoding (from the last stream's first token to
           the first stream's last); gateway via the Engine, mlx-lm via its BatchGenerator
llama.cpp is llama-cpp-python built from source by pip (the `bench` extra). On an Intel CPU
with AMX (seen on a 2-core Xeon VM, 2026-11-30) its native build crashed (SIGSEGV) at its
first decode; built without AMX it runs, and that is the build these numbers come from:
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON
  -DGGML_AVX_VNNI=ON" pip install --force-reinstall --no-deps llama-cpp-python

A CPU with AVX2 but no AVX-512 (Zen 2/3, Intel's client parts) runs other kernels on both
sides. An AVX-512 machine measures that pair too: llama.cpp built with -DGGML_AVX512=OFF
-DGGML_AVX_VNNI=OFF and the AMX options off (pip install --no-cache-dir --no-binary
llama-cpp-python --target DIR), then this script run with PYTHONPATH=DIR,
MLX_GATEWAY_CPU_ISA=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2. Intel's client parts since Alder
Lake add AVX-VNNI: the same with -DGGML_AVX_VNNI=ON and MLX_GATEWAY_CPU_ISA=avxvnni.

Peak RSS is VmHWM, reset (/proc/self/clear_refs 5) after loading and warming up, so it
covers the measured request's prefill and decode with the model resident.

    python bench/quantized.py [--models ...] [--configs ...] [--scenarios ...] [--skip-7b]
                              [--gen-tokens 128] [--reuse] [--repeat 1]

Every result is also stored in --results (JSON, keyed by model/config/scenario, with the
git state of the gateway's code); --reuse fills the cells this run did not measure from it
(marked *), so the parts can run separately. The machine may be shared: before each
measurement the driver waits (--idle-wait) for other processes to go quiet, records the
cores they kept busy meanwhile ("others' cores"), and --keep-quiet CORES reruns only the
cells measured while they used more. --repeat N measures every cell N times, in rounds
(each round runs every configuration of a model once, so a noisy minute falls on both
sides of a ratio), and a cell is the median of its runs, field by field; its record keeps
each run's numbers under "repeats".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quantized_workers import one_line  # noqa: E402
from bench._random_7b import Files, ensure  # noqa: E402

REAL = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
RANDOM_7B = "random-7b"
CONFIGS = ("gateway", "gateway-mlx4", "llama.cpp", "mlx-lm")
SCENARIOS = ("one@512", "one@8k", "streams")
# which configuration measures what (the benchmark section)
RUNS = {
    "gateway": ("one@512", "one@8k", "streams"),
    "gateway-mlx4": ("one@512", "one@8k", "streams"),
    "llama.cpp": ("one@512", "one@8k"),
    "mlx-lm": ("one@512", "streams"),
}


# ---------------------------------------------------------------- model files
def _model_files(alias: str, args: argparse.Namespace) -> tuple[Path, Path]:
    """(the GGUF, the MLX 4-bit folder), made when missing."""
    from gateway.cli.store.store import Store

    if alias == RANDOM_7B:
        tok = Store().resolve("qwen2.5-coder-0.5b")
        files = ensure(args.root, tok, args.llama_threads, log=_log)
        return files.q4km, files.mlx4
    gguf = Store().resolve(alias)
    folder = args.root / f"{alias}-mlx-4bit"
    if not (folder / "config.json").exists():
        _log(f"writing {folder} ...")
        out = _run_worker(["export", str(gguf), str(folder)], args.timeout)
        if "error" in out:
            raise RuntimeError(f"{alias}: MLX 4-bit export failed: {out['error']}")
    return gguf, folder


def _vocab(gguf: Path) -> int:
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(gguf)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


# ---------------------------------------------------------------- running workers
def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all cores, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_idle(limit_s: float, busy_cores: float = 0.15) -> float:
    """Wait (up to limit_s) until the other processes use under busy_cores cores over 5 s:
    the machine is shared and 2-thread runs (llama.cpp's spinning threads above all) lose
    most of their speed to any neighbour. The seconds waited."""
    start = time.perf_counter()
    while True:
        before = _busy_seconds()
        time.sleep(5.0)
        if (_busy_seconds() - before) / 5.0 < busy_cores:
            return time.perf_counter() - start
        if time.perf_counter() - start > limit_s:
            _log(f"  the machine stayed busy for {limit_s:.0f} s: measuring anyway")
            return time.perf_counter() - start


def _run_worker(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one worker; its JSON, with "others_cores": the cores other processes kept busy
    on average while it ran (0 on a quiet machine; a number near 1 means halved results)."""
    cmd = [sys.executable, str(ROOT / "bench" / "_quantized_workers.py"), *argv]
    start, busy, own = time.perf_counter(), _busy_seconds(), _children_cpu()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    seconds = time.perf_counter() - start
    others = (_busy_seconds() - busy - (_children_cpu() - own)) / seconds
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        tail = out.stderr.strip().splitlines()[-3:] or [f"exit status {out.returncode}"]
        return {"error": one_line(" / ".join(tail)), "seconds": seconds}
    result: dict[str, Any] = json.loads(lines[-1])
    result |= {"seconds": seconds, "others_cores": max(others, 0.0)}
    return result


def _git_state() -> str:
    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    dirty = git("status", "--short", "runtime/")
    return git("log", "--oneline", "-1")[:60] + (" + uncommitted runtime/" if dirty else "")


def _load_results(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


# ---------------------------------------------------------------- the driver
def _measured_quietly(result: dict[str, Any] | None, limit: float | None) -> bool:
    """--keep-quiet: a stored result measured while other processes kept under ``limit``
    cores busy is kept, not measured again."""
    if limit is None or result is None or "error" in result:
        return False
    return bool(result.get("others_cores", float("inf")) <= limit)


def _plan(alias: str, config: str, args: argparse.Namespace) -> list[str]:
    scenarios = [s for s in RUNS[config] if s in args.scenarios]
    if alias == RANDOM_7B:
        scenarios = [s for s in scenarios if s != "one@8k"]
        if config == "mlx-lm":  # no float copy fits to fill 8 contexts (docstring)
            scenarios = [s for s in scenarios if s != "streams"]
    return scenarios


def _worker_args(
    config: str, scenario: str, gguf: Path, folder: Path, vocab: int, args: argparse.Namespace
) -> list[str]:
    path = folder if config in ("mlx-lm", "gateway-mlx4") else gguf
    prompt = args.long_tokens if scenario == "one@8k" else args.prompt_tokens
    gen = args.mlxlm_gen_tokens if config == "mlx-lm" else args.gen_tokens
    streams = args.streams if scenario == "streams" else 1
    tail = 0
    if config == "mlx-lm":  # the docstring says why
        seven = path.name == Files.under(args.root).mlx4.name
        prompt = args.mlxlm_7b_prompt_tokens if seven else prompt
        tail = prompt if seven else min(args.mlxlm_tail, prompt)
    kind = {"gateway-mlx4": "gateway"}.get(config, config)
    numbers = (vocab, prompt, gen, streams, args.llama_threads, tail)
    return [kind, str(path), *(str(v) for v in numbers)]


def main() -> None:
    from runtime import backend

    backend.configure()  # MLX may load here (the 7B shape's MLX folder): the BLAS first
    from gateway.cli.store.store import gateway_home

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", default=[*REAL, RANDOM_7B])
    p.add_argument(
        "--configs", nargs="+", default=["gateway", "llama.cpp", "mlx-lm"], choices=CONFIGS
    )
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--skip-7b", action="store_true", help=f"leave out {RANDOM_7B}")
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--mlxlm-gen-tokens", type=int, default=16, help="mlx-lm's CPU path is slow")
    p.add_argument(
        "--mlxlm-tail",
        type=int,
        default=32,
        help="prompt tokens mlx-lm prefills itself (the rest: a float copy, see docstring)",
    )
    p.add_argument(
        "--mlxlm-7b-prompt-tokens", type=int, default=32, help="mlx-lm's prompt on the 7B shape"
    )
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--long-tokens", type=int, default=8000)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument(
        "--idle-wait",
        type=float,
        default=600.0,
        help="seconds to wait for a quiet machine before each measurement (0: do not wait)",
    )
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds per worker")
    p.add_argument("--root", type=Path, default=gateway_home() / "bench", help="generated models")
    p.add_argument("--results", type=Path, default=None, help="default: <root>/quantized.json")
    p.add_argument("--reuse", action="store_true", help="fill unmeasured cells from --results")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per cell, in rounds; a cell is their median"
    )
    p.add_argument(
        "--keep-quiet",
        type=float,
        default=None,
        metavar="CORES",
        help="keep stored results measured while others used <= CORES cores; rerun the rest",
    )
    args = p.parse_args()
    models = [m for m in args.models if not (args.skip_7b and m == RANDOM_7B)]
    results_file = args.results or args.root / "quantized.json"
    stored = _load_results(results_file)
    fresh: dict[str, Any] = {}
    for alias in models:
        start = time.perf_counter()
        gguf, folder = _model_files(alias, args)
        vocab = _vocab(gguf)
        runs: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(args.repeat):
            for config in args.configs:
                for scenario in _plan(alias, config, args):
                    key = f"{alias}|{config}|{scenario}"
                    if _measured_quietly(stored.get(key), args.keep_quiet) and key not in runs:
                        continue
                    _log(
                        f"{key} ..." + (f" (run {round_ + 1} of {args.repeat})" * (args.repeat > 1))
                    )
                    waited = wait_for_idle(args.idle_wait) if args.idle_wait > 0 else 0.0
                    out = _run_worker(
                        _worker_args(config, scenario, gguf, folder, vocab, args), args.timeout
                    )
                    out["waited_for_idle_s"] = waited
                    # the gateway's code may change during a long run: its state at each run
                    out["git"] = _git_state() if config.startswith("gateway") else ""
                    out["at"] = time.strftime("%Y-%m-%d %H:%M")
                    _log(f"  {json.dumps(out)}")
                    runs.setdefault(key, []).append(out)
                    fresh[key] = stored[key] = _median(runs[key])
                    results_file.parent.mkdir(parents=True, exist_ok=True)
                    results_file.write_text(json.dumps(stored, indent=1))
        _log(f"{alias}: {time.perf_counter() - start:.0f} s")
    cells = dict(stored) if args.reuse or args.keep_quiet is not None else {}
    reused = {k for k in cells if k not in fresh}
    cells.update(fresh)
    print(f"\ngateway code now: {_git_state()}")
    print_tables(models, cells, reused, args)


# the numbers a cell's runs are combined in (the rest is the first run's: its tokens, load)
MEDIAN_FIELDS = ("decode_tps", "prefill_tps", "aggregate_tps", "peak_rss_gb")


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run as it is; several as the first with each of MEDIAN_FIELDS the median of the
    runs that measured it and "others_cores" their most (a failed run fails the cell),
    every run's numbers under "repeats"."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    cell = dict(runs[0])
    for field in MEDIAN_FIELDS:
        values = [r[field] for r in runs if isinstance(r.get(field), int | float)]
        if values:
            cell[field] = statistics.median(values)
    cell["others_cores"] = max(r.get("others_cores", 0.0) for r in runs)
    cell["repeats"] = [{f: r.get(f) for f in (*MEDIAN_FIELDS, "others_cores", "at")} for r in runs]
    return cell


# ---------------------------------------------------------------- tables
def _cell(
    cells: dict[str, Any],
    reused: set[str],
    key: str,
    field: str,
    fmt: str = "{:.1f}",
    prompt: int = 0,
) -> str:
    """A value; "(pN)" when its prompt was not the column's, "*" when from an earlier run."""
    r = cells.get(key)
    if r is None:
        return ""
    if "error" in r:
        return "failed"
    value = r.get(field)
    if value is None:
        return "n/a"
    text = fmt.format(value)
    if prompt and r.get("prompt_tokens") not in (None, prompt):
        text += f" (p{r['prompt_tokens']})"
    return text + ("*" if key in reused else "")


def _ratio(cells: dict[str, Any], a: str, b: str, field: str) -> str:
    ra, rb = cells.get(a, {}), cells.get(b, {})
    va, vb = ra.get(field), rb.get(field)
    if not va or not vb:
        return ""
    return f"{va / vb:.2f}x"


def print_tables(
    models: list[str], cells: dict[str, Any], reused: set[str], args: argparse.Namespace
) -> None:
    n, p512, p8k = args.streams, args.prompt_tokens, args.long_tokens
    runs = "one run each" if args.repeat == 1 else f"the median of {args.repeat} runs each"
    print(
        f"\nprompts {args.prompt_tokens} / {args.long_tokens} tokens, {args.gen_tokens} generated "
        f"(mlx-lm {args.mlxlm_gen_tokens}), greedy, {runs}; llama.cpp {args.llama_threads} "
        f"threads; prefill at {args.long_tokens} (7B shape: at {args.prompt_tokens}); * = from an "
        "earlier run; others' cores: the most cores other processes kept busy during the "
        "row's runs (the machine is shared)"
    )
    print(
        f"| model | config | decode tok/s @{args.prompt_tokens} | decode tok/s @{args.long_tokens} "
        f"| {n} streams tok/s | prefill tok/s | peak RSS GB @{args.prompt_tokens} / "
        f"@{args.long_tokens} / {n} streams | others' cores |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for alias in models:
        long = "one@512" if alias == RANDOM_7B else "one@8k"
        for config in CONFIGS:
            base = f"{alias}|{config}|"
            if not any(k.startswith(base) for k in cells):
                continue
            expect = {"one@512": p512, "one@8k": p8k, "streams": p512}

            def cell(s: str, field: str, fmt: str = "{:.1f}") -> str:
                return _cell(cells, reused, base + s, field, fmt, expect[s])  # noqa: B023

            rss = " / ".join(cell(s, "peak_rss_gb", "{:.2f}") or "-" for s in SCENARIOS)
            errors = [
                cells[base + s]["error"] for s in SCENARIOS if "error" in cells.get(base + s, {})
            ]
            busy = max(cells.get(base + s, {}).get("others_cores", 0.0) for s in SCENARIOS)
            print(
                f"| {alias} | {config} | {cell('one@512', 'decode_tps')} "
                f"| {cell('one@8k', 'decode_tps')} | {cell('streams', 'aggregate_tps')} "
                f"| {cell(long, 'prefill_tps')} | {rss} | {busy:.2f} |"
            )
            for e in errors:
                print(f"|  | ({config} failed: {e}) | | | | | | |")
    print(
        "\n| model | decode @512 gw/llama | decode @8k gw/llama | prefill gw/llama "
        "| RSS @512 gw/llama | RSS @8k gw/llama | decode @512 gw/mlx-lm "
        f"| {n} streams gw/mlx-lm | gw {n} streams / gw one stream |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for alias in models:
        g, ll, ml = (f"{alias}|{c}|" for c in ("gateway", "llama.cpp", "mlx-lm"))
        long = "one@512" if alias == RANDOM_7B else "one@8k"
        cols = [
            _ratio(cells, g + "one@512", ll + "one@512", "decode_tps"),
            _ratio(cells, g + "one@8k", ll + "one@8k", "decode_tps"),
            _ratio(cells, g + long, ll + long, "prefill_tps"),
            _ratio(cells, g + "one@512", ll + "one@512", "peak_rss_gb"),
            _ratio(cells, g + "one@8k", ll + "one@8k", "peak_rss_gb"),
            _ratio(cells, g + "one@512", ml + "one@512", "decode_tps"),
            _ratio(cells, g + "streams", ml + "streams", "aggregate_tps"),
        ]
        one, many = cells.get(g + "one@512", {}), cells.get(g + "streams", {})
        if one.get("decode_tps") and many.get("aggregate_tps"):
            cols.append(f"{many['aggregate_tps'] / one['decode_tps']:.2f}x")
        else:
            cols.append("")
        print(f"| {alias} | " + " | ".join(cols) + " |")
    gits = {cells[k]["git"] for k in cells if cells[k].get("git")}
    print("\ngateway cells measured on: " + "; ".join(sorted(gits)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
