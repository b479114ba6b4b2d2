"""Do real agents' second requests hit the prefix cache? Replays captured client pairs.

Each pair is a client's first request and the one it sent next (with the tool result),
captured in shared/fixtures/clients: Claude Code over /v1/messages, Codex over
/v1/responses. The gateway is started twice, prefix cache on (its default budget) and
off (`--prefix-cache-bytes 0`); in each, every pair's first request runs, then its second.
Printed for the second request: prompt tokens, tokens served from the cache, the
longest prefix the two rendered prompts share (from the server's own per-request
debug record), and time to first token (first streamed delta of any kind), with the
on/off TTFT ratio. Targets (issue 8): cached >= 95% of the shared prefix, and TTFT
on <= 0.1x off.

    python bench/client_cache.py [--model qwen2.5-coder-0.5b | PATH | --tiny]
                                 [--pairs claude codex] [--max-tokens 8]

`--tiny` serves a tiny random Qwen3 with the real Qwen3 tokenizer and template (what the
test suite uses): it checks the cache mechanics on the full-size prompts in seconds.
On a CPU a 0.5B model prefills Claude Code's ~20k-token first request in tens of minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from bench._servers import ServerSpec, _free_port, _gateway_spec, _one_line, running  # noqa: E402

PAIRS = {
    "claude": ("/v1/messages", "claude_code_first_request", "claude_code_tool_result_request"),
    "codex": ("/v1/responses", "codex_first_request", "codex_tool_result_request"),
}
TIMEOUT_S = 7200.0


@dataclass(frozen=True)
class Sent:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    shared_prefix: int | None  # tokens the prompt shares with the server's earlier ones


def _fixtures(given: str | None) -> Path:
    for folder in ([Path(given)] if given else []) + [
        ROOT / "shared/fixtures/clients",
        ROOT.parent / "shared/fixtures/clients",
    ]:
        if (folder / "codex_first_request.json").is_file():
            return folder
    raise SystemExit("no shared/fixtures/clients next to the checkout; pass --fixtures")


def _body(folder: Path, name: str, model: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((folder / f"{name}.json").read_text())
    body["model"] = model
    body["stream"] = True
    if "input" in body:
        body["max_output_tokens"] = max_tokens
    else:
        body["max_tokens"] = max_tokens
    return body


def _usage(path: str, event: dict[str, Any], into: dict[str, int]) -> None:
    """Token counts from the events that carry them, in either dialect."""
    if path == "/v1/responses":
        usage = (event.get("response") or {}).get("usage") or {}
        if usage:
            into["prompt"] = usage.get("input_tokens", 0)
            into["cached"] = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        return
    usage = (event.get("message") or {}).get("usage") or event.get("usage") or {}
    if "cache_read_input_tokens" in usage or "input_tokens" in usage:
        cached = usage.get("cache_read_input_tokens") or into.get("cached", 0)
        fresh = usage.get("input_tokens", 0) + (usage.get("cache_creation_input_tokens") or 0)
        into["cached"] = cached
        into["prompt"] = max(into.get("prompt", 0), fresh + cached)


def send(base: str, path: str, body: dict[str, Any]) -> Sent:
    counts: dict[str, int] = {}
    first: float | None = None
    start = time.perf_counter()
    with httpx.stream("POST", base + path, json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path} -> {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = str(event.get("type", ""))
            if first is None and kind.endswith("delta") and kind != "message_delta":
                first = time.perf_counter() - start
            _usage(path, event, counts)
    done = time.perf_counter() - start
    return Sent(counts.get("prompt", 0), counts.get("cached", 0), first or done, _shared(base))


def _shared(base: str) -> int | None:
    """The server's own account of the last request's match against the trie."""
    try:
        data = httpx.get(base + "/debug/prefix-cache", timeout=60).json()
    except (httpx.HTTPError, ValueError):
        return None
    recent = data.get("recent") or data.get("requests") or []
    if not recent:
        return None
    last = recent[-1]
    for key in ("shared_prefix", "longest_prefix", "matched_tokens", "matched"):
        if isinstance(last.get(key), int):
            return int(last[key])
    return None


def run(
    spec: ServerSpec, port: int, args: argparse.Namespace, folder: Path, log: Path
) -> dict[str, Sent]:
    out: dict[str, Sent] = {}
    with running(spec, port, log) as base:
        model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
        for pair in args.pairs:
            path, first, second = PAIRS[pair]
            send(base, path, _body(folder, first, model, args.max_tokens))
            out[pair] = send(base, path, _body(folder, second, model, args.max_tokens))
    return out


def _tiny_model() -> str:
    from tests.support.agent_model import build_tiny_qwen3
    from tests.support.fixtures_real import npm_tokenizer_dir

    folder = Path(tempfile.mkdtemp(prefix="tiny-qwen3-"))
    return str(build_tiny_qwen3(npm_tokenizer_dir("qwen3"), folder))


def _print(results: dict[str, dict[str, Sent]], pairs: Sequence[str]) -> None:
    print("\n| pair | cache | prompt tokens | cached | shared prefix | cached / shared | TTFT s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for pair in pairs:
        for name, rows in results.items():
            sent = rows.get(pair)
            if sent is None:
                continue
            share = (
                f"{sent.cached_tokens / sent.shared_prefix:.1%}"
                if sent.shared_prefix and name == "on"
                else "-"
            )
            # with the cache off the server matches nothing: its record says 0
            shared = sent.shared_prefix if sent.shared_prefix and name == "on" else "-"
            print(
                f"| {pair} | {name} | {sent.prompt_tokens} | {sent.cached_tokens} | "
                f"{shared} | {share} | {sent.ttft_s:.2f} |"
            )
    print("\n| pair | TTFT on / off | target |")
    print("|---|---:|---|")
    for pair in pairs:
        on, off = results.get("on", {}).get(pair), results.get("off", {}).get(pair)
        if on and off and off.ttft_s > 0:
            ratio = on.ttft_s / off.ttft_s
            verdict = "ok" if ratio <= 0.1 else "MISSED"
            print(f"| {pair} | {ratio:.3f}x | <= 0.1x: {verdict} |")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="alias or path to serve")
    p.add_argument("--tiny", action="store_true", help="serve a tiny random Qwen3 instead")
    p.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=sorted(PAIRS))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--fixtures", default=None)
    args = p.parse_args(argv)
    folder = _fixtures(args.fixtures)
    model = _tiny_model() if args.tiny else args.model
    logdir = Path(tempfile.mkdtemp(prefix="client-cache-"))
    results: dict[str, dict[str, Sent]] = {}
    for name, spec_name in (("on", "gateway"), ("off", "gateway-nocache")):
        port = _free_port()
        spec = _gateway_spec(spec_name, model, port)
        print(f"{name}: {' '.join(spec.cmd[2:])} (log {logdir / name}.log)", flush=True)
        try:
            results[name] = run(spec, port, args, folder, logdir / f"{name}.log")
        except Exception as exc:  # one server failing must not hide the other's numbers
            print(f"{name}: FAILED {_one_line(exc)}")
    _print(results, args.pairs)


if __name__ == "__main__":
    main()
