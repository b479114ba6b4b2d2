"""The tables bench/long_prefill.py prints from its measurements (a JSON-able report)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

from bench._long_prompts import REFERENCE

GB = 1e9
LLAMA = "llama.cpp"
LONG = 8000  # from here on the gateway's TTFT must be at most llama.cpp's
TTFT_TARGET, SELF_TARGET, MEMORY_TARGET = 1.0, 0.5, 1.5

Run = dict[str, Any]


def _ok(r: Run | None) -> TypeGuard[Run]:
    return r is not None and "error" not in r


def _cell(r: Run | None, fmt: Callable[[Run], str]) -> str:
    if r is None:
        return "-"
    return fmt(r) if "error" not in r else "FAILED"


def _num(r: Run | None, key: str) -> float | None:
    """A run's number, or None when it did not run or failed."""
    return float(r[key]) if r is not None and "error" not in r else None


def _ratio(a: float | None, b: float | None, fmt: str = "{:.2f}x") -> str:
    return fmt.format(a / b) if a is not None and b else "-"


def _load(r: Run) -> str:
    return f"{r.get('others_cores', 0.0):.2f}"


def _agree(gw: Run | None, ll: Run | None) -> str:
    """How many greedy tokens the two engines share from the start (the same ids went in;
    llama.cpp's quantized kernels and our float32 ones may part ways after a while)."""
    if not (_ok(gw) and _ok(ll)):
        return "-"
    a, b = gw["generated"], ll["generated"]
    same = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return f"{same}/{min(len(a), len(b))}"


def _labels(report: dict[str, Any]) -> list[str]:
    return list(dict.fromkeys(r["run"] for r in report["runs"] if r["run"] != LLAMA))


def _longest(report: dict[str, Any]) -> str:
    """The 32k prompt if it ran, else the longest one."""
    prompts: dict[str, int] = report["prompts"]
    return "32k" if "32k" in prompts else max(prompts, key=lambda n: prompts[n])


def _table(report: dict[str, Any], by: dict[tuple[str, str], Run]) -> None:
    print(
        "| prompt | tokens | gateway run | TTFT gateway s | TTFT llama.cpp s | gateway / llama.cpp "
        "| prefill gateway tok/s | prefill llama.cpp tok/s | gateway prefill vs its 512 "
        "| decode gateway tok/s | decode llama.cpp tok/s | peak gateway GB (MLX / RSS) "
        "| peak llama.cpp GB (RSS) | greedy tokens agree | other load, cores (gateway / llama.cpp) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tokens in report["prompts"].items():
        ll = by.get((name, LLAMA))
        for label in _labels(report):
            gw, ref = by.get((name, label)), by.get((REFERENCE, label))
            ttft = _ratio(_num(gw, "ttft_s"), _num(ll, "ttft_s"))
            own = _ratio(_num(gw, "prefill_tps"), _num(ref, "prefill_tps"))
            cells = [
                name, str(tokens), label,
                _cell(gw, lambda r: f"{r['ttft_s']:.2f}"), _cell(ll, lambda r: f"{r['ttft_s']:.2f}"),
                ttft,
                _cell(gw, lambda r: f"{r['prefill_tps']:.1f}"),
                _cell(ll, lambda r: f"{r['prefill_tps']:.1f}"),
                own,
                _cell(gw, lambda r: f"{r['decode_tps']:.1f}"),
                _cell(ll, lambda r: f"{r['decode_tps']:.1f}"),
                _cell(gw, lambda r: f"{r['peak_mlx_bytes'] / GB:.2f} / {r['peak_rss_bytes'] / GB:.2f}"),
                _cell(ll, lambda r: f"{r['peak_rss_bytes'] / GB:.2f}"),
                _agree(gw, ll),
                f"{_cell(gw, _load)} / {_cell(ll, _load)}",
            ]  # fmt: skip
            print("| " + " | ".join(cells) + " |")


def _targets(report: dict[str, Any], by: dict[tuple[str, str], Run]) -> None:
    print("\n| target | prompt | gateway run | measured | verdict |")
    print("|---|---|---|---:|---|")
    long = _longest(report)
    for label in _labels(report):
        for name, tokens in report["prompts"].items():
            gw, ll = by.get((name, label)), by.get((name, LLAMA))
            if tokens >= LONG and _ok(gw) and _ok(ll):
                ratio = gw["ttft_s"] / ll["ttft_s"]
                verdict = "ok" if ratio <= TTFT_TARGET else "MISSED"
                print(f"| TTFT gateway / llama.cpp <= {TTFT_TARGET} | {name} | {label} "
                      f"| {ratio:.2f}x | {verdict} |")  # fmt: skip
        gw, ref = by.get((long, label)), by.get((REFERENCE, label))
        if long != REFERENCE and _ok(gw) and _ok(ref):
            ratio = gw["prefill_tps"] / ref["prefill_tps"]
            verdict = "ok" if ratio >= SELF_TARGET else "MISSED"
            print(f"| prefill tok/s vs own at 512 >= {SELF_TARGET} | {long} | {label} "
                  f"| {ratio:.2f}x | {verdict} |")  # fmt: skip


def _compute(report: dict[str, Any], by: dict[tuple[str, str], Run]) -> None:
    """How fast the gateway's prefill computes, and what that allows: at the 512
    prompt's flop rate, a long prompt's tokens/s can be at most its flops per token
    against the 512's (attention grows with the context; the weights' share does not)."""
    print("\n| prompt | gateway run | prefill GFLOP | GFLOP/s | tok/s vs 512 "
          "| tok/s vs 512 at the 512's GFLOP/s |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for label in _labels(report):
        ref = by.get((REFERENCE, label))
        for name, tokens in report["prompts"].items():
            gw = by.get((name, label))
            if not (_ok(gw) and _ok(ref) and "prefill_flops" in gw and "prefill_flops" in ref):
                continue
            bound = (ref["prefill_flops"] / ref["tokens"]) / (gw["prefill_flops"] / tokens)
            print(f"| {name} | {label} | {gw['prefill_flops'] / 1e9:.0f} "
                  f"| {gw['prefill_flops'] / gw['ttft_s'] / 1e9:.1f} "
                  f"| {gw['prefill_tps'] / ref['prefill_tps']:.2f}x | {bound:.2f}x |")  # fmt: skip


def _memory(report: dict[str, Any], by: dict[tuple[str, str], Run]) -> None:
    long = _longest(report)
    print(f"\nmemory at the {long} prompt ({report['prompts'][long]} tokens + "
          f"{report['gen_tokens']} generated), target peak <= {MEMORY_TARGET}x weights + KV:")  # fmt: skip
    for label in _labels(report):
        gw = by.get((long, label))
        if not _ok(gw):
            continue
        need = gw["weights_bytes"] + gw["kv_bytes"]
        for what, key in (("MLX peak", "peak_mlx_bytes"), ("process RSS peak", "peak_rss_bytes")):
            ratio = gw[key] / need
            verdict = "ok" if ratio <= MEMORY_TARGET else "MISSED"
            print(
                f"  {label}: {what} {gw[key] / GB:.2f} GB vs weights {gw['weights_bytes'] / GB:.2f}"
                f" + KV {gw['kv_bytes'] / GB:.2f} ({gw['dtype']}) = {need / GB:.2f} GB: "
                f"{ratio:.2f}x, {verdict}"
            )
        if not gw.get("hwm_reset"):
            print("  (the RSS peak could not be reset after loading: it includes the load)")


def print_report(report: dict[str, Any]) -> None:
    by = {(r["prompt"], r["run"]): r for r in report["runs"]}
    llama = report["llama"]
    ok = [r for r in report["runs"] if _ok(r)]
    version = next((r["version"] for r in ok if r["run"] == LLAMA), "?")
    gw = next((r for r in ok if r["run"] != LLAMA), None)
    ours = (
        f"{gw['dtype']}, prefill chunk {gw.get('prefill_chunk')}, prefix cache "
        + (f"{gw['prefix_cache_bytes'] / GB:.1f} GB" if gw.get("prefix_cache_bytes") else "off")
        if gw
        else "?"
    )
    peer = (
        f"llama.cpp: llama-cpp-python {version}, {llama['threads']} threads, n_batch "
        f"{llama['batch']}, flash attention {'on' if llama['flash_attn'] else 'off'}."
        if any(r["run"] == LLAMA for r in report["runs"])
        else "llama.cpp: skipped."
    )
    print(
        f"\n{report['model']}: one request at a time, greedy, {report['gen_tokens']} tokens "
        f"decoded after each prompt (EOS ignored). gateway: {ours} (first run). {peer}"
    )
    _table(report, by)
    busy = max((r.get("others_cores", 0.0) for r in ok), default=0.0)
    if busy > 0.25:
        print(
            f"\nother processes kept up to {busy:.2f} cores busy during the timings (last "
            "column): every number is slower than on an idle machine, llama.cpp's most (its "
            "threads wait for each other at every step)"
        )
    _targets(report, by)
    _compute(report, by)
    _memory(report, by)
