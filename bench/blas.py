"""The CPU backend's BLAS choices side by side: which one runs prompts fastest here.

runtime/backend.py preloads a BLAS before MLX (process-wide), so each choice runs in
processes of its own, one after the other, round after round (the machine is shared:
each cell is the best of its rounds):
  system:openblas  the distribution's OpenBLAS (Debian: libopenblas0-pthread)
  pip:mkl          MKL from pip (the `cpu` extra, x86-64)
  pip:openblas     scipy-openblas32 from pip (the `cpu` extra) through runtime/blas_shim.c
  none             MLX's bundled reference BLAS (one round, the first length only: slow)
A choice may carry "+KEY=VALUE" settings for its processes' environment, e.g.
pip:openblas+OPENBLAS_CORETYPE=SkylakeX (OpenBLAS's AVX-512 kernels where it picks
Haswell's on a processor it does not know).

Measured in each process: float32 sgemm GFLOP/s of a 512x896 by 896x4864 product (a
prompt chunk through Qwen2.5-0.5B's MLP, `x @ w.T` as a linear layer does it); the same
product with the weight 4-bit quantized, through the MLX extension's prompt path
(dequantized tiles into cblas_sgemm, runtime/kernels); and prefill tok/s of
Qwen2.5-Coder-0.5B's Q4_K_M GGUF through runtime.load + the engine (prefix cache off).
Each figure comes twice: per second of wall time, and per 2 seconds of this process's
CPU time (all its threads; "cpu" in the JSON, "/cpu" in the table): what 2 idle cores
would give if every CPU second it spent went to work, a measure that other processes on
a busy machine disturb far less, while threads that spin as they wait still pay for it.
Ratios are against the first choice listed. Each process first waits (up to --wait-idle
seconds) for the other processes on the machine to leave the cores nearly idle, and
records how many cores they kept busy while it measured ("others" in the table: the
cell's runs, worst).

    python bench/blas.py [--choices system:openblas,pip:mkl,pip:openblas,none]
        [--lengths 512,2048] [--rounds 3] [--wait-idle 600] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

MODEL_GLOB = "qwen2.5-coder-0.5b/*.gguf"
ROWS, DEPTH, COLS = 512, 896, 4864
GEMM_REPS = 20
PREFILL_REPS = 2
SLOW = "none"  # the reference BLAS: one round, one length
TIMEOUT_S = 1800.0
IDLE_CORES = 0.3  # what counts as a nearly idle machine (busy cores, all processes)


def model_path() -> Path:
    home = Path(os.environ.get("MLX_GATEWAY_HOME", Path.home() / ".cache" / "mlx-gateway"))
    found = sorted((home / "models").glob(MODEL_GLOB))
    if not found:
        raise SystemExit(f"no GGUF under {home / 'models'} matching {MODEL_GLOB}")
    return found[0]


# ---------------------------------------------------------------- load of the machine
def cpu_mark() -> tuple[float, float, float]:
    """(wall, CPU seconds busy on the whole machine, CPU seconds of this process)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(f) for f in fields]
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    return time.perf_counter(), busy, time.process_time()


def others_since(before: tuple[float, float, float]) -> float:
    """Cores that other processes kept busy since `before`, on average."""
    after = cpu_mark()
    wall = after[0] - before[0]
    return max((after[1] - before[1]) - (after[2] - before[2]), 0.0) / max(wall, 1e-9)


def wait_idle(limit_s: float) -> float:
    """Wait until the machine is nearly idle for 3 s, at most `limit_s`; the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        mark = cpu_mark()
        time.sleep(3.0)
        if others_since(mark) < IDLE_CORES:
            break
    return time.perf_counter() - start


# ---------------------------------------------------------------- the measuring process
CORES = 2.0  # the cores the CPU-time figures are scaled to


def _best_seconds(run: Any, reps: int) -> tuple[float, float]:
    """The fewest wall seconds and the fewest CPU seconds / CORES of one call."""
    import mlx.core as mx

    mx.eval(run())  # warm: packing buffers, thread pools, tile buffers
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        start, cpu = time.perf_counter(), time.process_time()
        mx.eval(run())
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, (time.process_time() - cpu) / CORES)
    return best, best_cpu


def products() -> dict[str, Any]:
    """GFLOP/s of the float32 product and of the quantized prompt path, and their errors
    against numpy's float64 product."""
    import mlx.core as mx
    import numpy as np

    from runtime import kernels

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((ROWS, DEPTH), dtype=np.float32)
    w_np = rng.standard_normal((COLS, DEPTH), dtype=np.float32) / DEPTH**0.5
    x, w = mx.array(x_np), mx.array(w_np)
    flops = 2.0 * ROWS * DEPTH * COLS
    out: dict[str, Any] = {}
    sgemm, sgemm_cpu = _best_seconds(lambda: x @ w.T, GEMM_REPS)
    reference = x_np.astype(np.float64) @ w_np.astype(np.float64).T
    out["sgemm_gflops"] = flops / sgemm / 1e9
    out["sgemm_gflops_cpu"] = flops / sgemm_cpu / 1e9
    out["sgemm_error"] = float(np.abs(np.array(x @ w.T) - reference).max())
    if kernels.quantized_ready() and kernels.extension() is not None:
        wq, scales, biases = mx.quantize(w, group_size=32, bits=4)

        def qmm() -> mx.array:
            return kernels.qmatmul(x, wq, scales, biases, group_size=32, bits=4)

        dense = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=4))
        qmm_s, qmm_cpu = _best_seconds(qmm, GEMM_REPS)
        out["qmatmul_gflops"] = flops / qmm_s / 1e9
        out["qmatmul_gflops_cpu"] = flops / qmm_cpu / 1e9
        out["qmatmul_error"] = float(np.abs(np.array(qmm()) - x_np @ dense.T).max())
    return out


def prefill(gguf: Path, lengths: list[int]) -> dict[str, Any]:
    """Best prefill tok/s of each prompt length (fresh ids each time: nothing cached)."""
    from dataclasses import replace

    from runtime.engine import Engine, ModelRunner, RunnerSettings
    from runtime.load import load
    from runtime.types import Finished, GenerationRequest, SamplingParams

    loaded = load(gguf)
    vocab = int(loaded.config["vocab_size"])
    loaded = replace(loaded, eos_token_ids=frozenset())
    engine = Engine(ModelRunner(loaded, RunnerSettings(prefix_cache_bytes=0, speculative="off")))
    engine.start()
    greedy = SamplingParams(temperature=0.0)
    out: dict[str, Any] = {"quantized": loaded.quantized}
    try:
        seed = 0
        for n in [64, *lengths]:  # 64: warm-up
            best = best_cpu = 0.0
            for _ in range(PREFILL_REPS if n != 64 else 1):
                seed += 1
                ids = tuple((1009 * i + 7 * seed) % (vocab - 512) + 256 for i in range(n))
                done, cpu = None, time.process_time()
                for event in engine.submit(GenerationRequest(ids, 1, greedy)):
                    done = event if isinstance(event, Finished) else done
                if not isinstance(done, Finished) or done.error or done.stats.cached_tokens:
                    raise RuntimeError(f"the request did not run as measured: {done}")
                best = max(best, done.stats.prefill_tps)
                best_cpu = max(best_cpu, n / ((time.process_time() - cpu) / CORES))
            if n != 64:
                out[f"prefill_{n}"] = best
                out[f"prefill_{n}_cpu"] = best_cpu
    finally:
        engine.stop()
    return out


def worker(lengths: list[int]) -> dict[str, Any]:
    from runtime import backend

    choice = backend.configure()  # before MLX (runtime/backend.py)
    info: dict[str, Any] = {"blas": choice.source, "path": choice.path}
    mark = cpu_mark()
    info |= products()
    info |= prefill(model_path(), lengths)
    info["others"] = others_since(mark)
    return info


# ---------------------------------------------------------------- the driver
def run_choice(choice: str, lengths: list[int], wait_s: float) -> dict[str, Any]:
    source, *settings = choice.split("+")
    env = dict(os.environ, MLX_GATEWAY_BLAS=source)
    for setting in settings:
        key, _, value = setting.partition("=")
        env[key] = value
    args = [sys.executable, __file__, "--worker", "--lengths", ",".join(map(str, lengths))]
    waited = wait_idle(wait_s)
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    result: dict[str, Any] = json.loads(lines[-1])
    result["waited_s"] = waited
    if result["blas"] != source and source != SLOW:
        result["error"] = f"asked for {source}, got {result['blas']}"
    return result


METRICS = ("sgemm_gflops", "qmatmul_gflops")


def table(best: dict[str, dict[str, Any]], lengths: list[int]) -> str:
    plain = [*METRICS, *(f"prefill_{n}" for n in lengths)]
    keys = [k for key in plain for k in (key, f"{key}_cpu")]
    names = ["sgemm GFLOP/s", "4-bit prompt path GFLOP/s", *(f"prefill {n} tok/s" for n in lengths)]
    heads = [*(h for name in names for h in (name, f"{name} /cpu")), "others"]
    base = next(iter(best.values()))
    rows = ["| BLAS | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for choice, res in best.items():
        cells = []
        for key in keys:
            value, ref = res.get(key), base.get(key)
            if value is None:
                cells.append(res.get("error", "-"))
            elif ref:
                cells.append(f"{value:.1f} ({value / ref:.2f}x)")
            else:
                cells.append(f"{value:.1f}")
        cells.append(f"{res.get('others', float('nan')):.2f}")
        rows.append(f"| {choice} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--choices", default="system:openblas,pip:mkl,pip:openblas,none")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait-idle", type=float, default=600.0, help="seconds, at most")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if args.worker:
        print(json.dumps(worker(lengths)), flush=True)
        return
    choices = [c for c in args.choices.split(",") if c]
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in choices}
    for round_ in range(args.rounds):
        for choice in choices:
            if choice.startswith(SLOW) and round_ > 0:
                continue
            todo = lengths[:1] if choice.startswith(SLOW) else lengths
            result = run_choice(choice, todo, args.wait_idle)
            runs[choice].append(result)
            print(f"round {round_ + 1} {choice}: {json.dumps(result)}", file=sys.stderr)
    best: dict[str, dict[str, Any]] = {}
    for choice, results in runs.items():
        ok = [r for r in results if "error" not in r]
        cell: dict[str, Any] = dict(ok[0]) if ok else dict(results[0])
        for r in ok[1:]:
            for key, value in r.items():
                if key.endswith(("_gflops", "_cpu")) or key.startswith("prefill_"):
                    cell[key] = max(cell.get(key) or 0.0, value)
                elif key == "others":
                    cell[key] = max(cell[key], value)
        best[choice] = cell
    print(table(best, lengths))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "best": best}, indent=1))


if __name__ == "__main__":
    main()
