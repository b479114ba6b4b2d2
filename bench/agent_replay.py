"""Agent-style replay against the gateway's shared prefix cache, and its peers, in one run.

Several conversations run interleaved round-robin (c1t1, c2t1, c3t1, c1t2, ...). Every turn
resends the whole history -- a long system prompt carrying a coding agent's instructions and
tool list (cut from shared/fixtures/clients to --system-tokens), the earlier user messages
and the server's own earlier replies -- plus a new user message, the way agent clients do.
The tool list travels inside the system text, for every server alike (the gateway does not
take `tools` yet). Greedy, streaming with usage.

Servers, one after another (this machine has 2 cores), each started, warmed up with one
unrelated request (~300 tokens, so first-use costs of prefill stay out of turn 1), replayed,
stopped:
  gateway          `mlx-gateway serve`, prefix cache on (its default budget)
  gateway-nocache  `mlx-gateway serve --prefix-cache-bytes 0`
  mlx-lm           `mlx_lm.server` on our loader's float32 weights, same BLAS, its own
                   LRU prompt cache sized to hold every conversation
  llama.cpp        `llama_cpp.server` (llama-cpp-python) on the GGUF itself (its native
                   quantized path), RAM prompt cache on

Per request: time to first token (first SSE chunk with text or a finish reason), prompt
tokens, and the tokens the server says it reused (the gateway and mlx-lm in
usage.prompt_tokens_details.cached_tokens, llama.cpp in its log's "prefix-match hit").
"Reusable" is computed here with the model's tokenizer and chat template: the longest common
prefix between the prompt and any earlier request's prompt, or prompt-plus-reply rendered as
a conversation, capped at len(prompt) - 1 (one token must run to produce logits).

    python bench/agent_replay.py [--conversations 3] [--turns 4] [--system-tokens 2000]
                                 [--max-tokens 20] [--servers gateway mlx-lm ...] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
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

from bench._servers import (  # noqa: E402
    ServerSpec,
    _free_port,
    _gateway_spec,
    _llama_spec,
    _mlx_spec,
    _one_line,
    running,
)

SERVERS = ("gateway", "gateway-nocache", "mlx-lm", "llama.cpp")
FIXTURE = "shared/fixtures/clients/opencode_first_request_chat.json"
REQUEST_TIMEOUT_S = 300.0
TARGET_VS_OFF = 0.2
TARGET_VS_MLX = 0.5
TARGET_REUSE = 0.95

FIRST_USERS = (
    "show hello.txt",
    "The tests in tests/test_parser.py fail since yesterday. Find out why and fix them.",
    "Add a --verbose flag to the CLI in src/cli.py that prints every request it sends.",
    "Rename the function load_config to read_config everywhere in the repository.",
    "Write a README section explaining how to run the benchmarks.",
    "Why is the build slow? Look at the Makefile and suggest what to cache.",
)
FOLLOW_UPS = (
    "Thanks. Now list the files in the src directory and tell me which one is largest.",
    "That did not work: the command printed 'permission denied'. What should I try instead?",
    "Good. Please also update the changelog with one line describing the change.",
    "Run the test suite again and summarise the failures, if any, in two sentences.",
    "Can you make the change smaller? Only touch the files that really need it.",
    "Now commit the work with a short message in the imperative mood.",
)


# ---------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    system: str
    conversations: int
    turns: int
    max_tokens: int
    warmup_words: int = 100

    def order(self) -> list[tuple[int, int]]:
        """(conversation, turn) pairs, round-robin over conversations."""
        return [(c, t) for t in range(self.turns) for c in range(self.conversations)]

    def user_message(self, conv: int, turn: int) -> str:
        if turn == 0:
            return FIRST_USERS[conv % len(FIRST_USERS)]
        return FOLLOW_UPS[(conv + turn - 1) % len(FOLLOW_UPS)]


def _find_fixture(given: str | None) -> Path | None:
    candidates = [Path(given)] if given else [ROOT / FIXTURE, ROOT.parent / FIXTURE]
    return next((p for p in candidates if p.is_file()), None)


def _synthetic_parts() -> tuple[str, list[dict[str, Any]]]:
    """A stand-in shaped like the client fixtures when they are not checked out."""
    prose = " ".join(
        f"Rule {i}: before you edit a file read it, keep changes minimal, run the tests, "
        f"and explain in one sentence what you changed and why."
        for i in range(200)
    )
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool number {i}: operates on files in the workspace. " * 8,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Absolute path of the file"},
                        "limit": {"type": "integer", "description": "How many lines at most"},
                    },
                    "required": ["path"],
                },
            },
        }
        for i in range(40)
    ]
    return prose, tools


def _fixture_parts(path: Path | None) -> tuple[str, list[dict[str, Any]]]:
    if path is None:
        return _synthetic_parts()
    data = json.loads(path.read_text(encoding="utf-8"))
    system = [m for m in data.get("messages", []) if m.get("role") == "system"]
    prose = "\n\n".join(str(m.get("content") or "") for m in system)
    return prose, list(data.get("tools") or [])


def system_text(acct: Accountant, fixture: Path | None, n_tokens: int) -> str:
    """The agent's instructions (about 40% of the budget) then its tool list, cut to
    `n_tokens` tokens at token boundaries."""
    prose, tools = _fixture_parts(fixture)
    tool_text = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    head = acct.cut(prose, int(n_tokens * 0.4))
    tail = "\n\n# Tools\n\nYou can call these functions (answer with a JSON call):\n"
    rest = n_tokens - acct.count(head) - acct.count(tail)
    return head + tail + acct.cut(tool_text, max(rest, 0))


# ---------------------------------------------------------------- token accounting
class Accountant:
    """The model's own tokenizer and chat template, as the gateway renders prompts."""

    def __init__(self, model: Path) -> None:
        from runtime.text import Tokenizer, read_chat_template
        from templates import renderer_for

        if model.is_dir():  # a HF folder: config.json, tokenizer.json, tokenizer_config.json
            config = json.loads((model / "config.json").read_text())
            config = {**config, **config.get("text_config", {})}
            self.tok = Tokenizer.from_folder(model)
            self.chat_template = read_chat_template(model)
        else:
            from runtime.load import GGUFFile, hf_config, tokenizer_from_gguf

            gf = GGUFFile(model)
            config = hf_config(gf)
            self.tok = tokenizer_from_gguf(gf)
            template = gf.get("tokenizer.chat_template")
            self.chat_template = str(template) if template else None
        self.renderer = renderer_for(
            self.chat_template,
            bos_token=self.tok.bos_token,
            eos_token=self.tok.eos_token,
            model_type=str(config.get("model_type", "")),
        )
        self.context_length = int(config.get("max_position_embeddings") or 8192)

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def cut(self, text: str, n: int) -> str:
        return self.tok.decode(self.tok.encode(text, add_special_tokens=False)[:n])

    def render(self, messages: Sequence[dict[str, str]], *, generation_prompt: bool) -> list[int]:
        from templates import Message, RenderOptions

        msgs = [Message(role=m["role"], content=m["content"]) for m in messages]
        text = self.renderer.render(
            msgs, (), RenderOptions(add_generation_prompt=generation_prompt)
        )
        return self.tok.encode_prompt(text)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reusable(prompt: Sequence[int], history: Sequence[Sequence[int]]) -> int:
    best = max((_lcp(prompt, h) for h in history), default=0)
    return max(0, min(best, len(prompt) - 1))


# ---------------------------------------------------------------- HTTP
@dataclass(frozen=True)
class Reply:
    ttft: float
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None


def chat(base: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> Reply:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    first: float | None = None
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if first is None and (piece or choice.get("finish_reason")):
                    first = time.perf_counter()
                pieces.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Reply(
        ttft=(first or time.perf_counter()) - start,
        text="".join(pieces),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=int(cached) if isinstance(cached, int) else None,
    )


# ---------------------------------------------------------------- replay
@dataclass(frozen=True)
class TurnResult:
    conv: int
    turn: int
    ttft: float
    prompt_tokens: int  # as the server reports it, else as counted here
    reusable: int
    reused: int | None  # as the server reports it


@dataclass(frozen=True)
class ServerResult:
    name: str
    note: str
    turns: tuple[TurnResult, ...] = ()
    error: str | None = None
    extra: str = ""
    load: str = (
        ""  # the machine's 1-minute load average before and after: others' work skews timings
    )


class _LogReader:
    """New text of a server log since the last read (for servers that log reuse)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def new_text(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode("utf-8", errors="replace")


def _logged_reuse(pattern: str | None, reader: _LogReader) -> int | None:
    if pattern is None:
        return None
    hits = re.findall(pattern, reader.new_text())
    return int(hits[-1]) if hits else 0


@dataclass
class Transcript:
    """The conversations so far and every prompt (and prompt + reply) a server has seen:
    a replay may go on against a restarted server (bench/restart_replay.py)."""

    convs: list[list[dict[str, str]]]
    history: list[list[int]]

    @classmethod
    def start(cls, work: Workload) -> Transcript:
        return cls(
            [[{"role": "system", "content": work.system}] for _ in range(work.conversations)], []
        )


def warm_up(
    base: str, spec: ServerSpec, work: Workload, acct: Accountant, reader: _LogReader
) -> list[int]:
    """One request unrelated to the replay (no shared system prompt) but long enough to
    run prefill once; the rendered conversation, for the reuse accounting."""
    warm = [
        {"role": "user", "content": "Count these words: " + "apple pear plum " * work.warmup_words}
    ]
    reply = chat(base, spec.model, warm, 4)
    reader.new_text()
    return acct.render(
        [*warm, {"role": "assistant", "content": reply.text}], generation_prompt=False
    )


def replay(
    base: str,
    spec: ServerSpec,
    work: Workload,
    acct: Accountant,
    log: Path,
    pairs: Sequence[tuple[int, int]] | None = None,
    transcript: Transcript | None = None,
) -> list[TurnResult]:
    """Run the (conversation, turn) `pairs` (all of them by default) against `base`,
    going on from `transcript` (a fresh one by default)."""
    reader = _LogReader(log)
    state = transcript or Transcript.start(work)
    state.history.append(warm_up(base, spec, work, acct, reader))
    results = []
    for c, t in work.order() if pairs is None else pairs:
        messages = [*state.convs[c], {"role": "user", "content": work.user_message(c, t)}]
        prompt = acct.render(messages, generation_prompt=True)
        can_reuse = reusable(prompt, state.history)
        reply = chat(base, spec.model, messages, work.max_tokens)
        reused = reply.cached_tokens
        if reused is None:
            reused = _logged_reuse(spec.log_reuse, reader)
        state.convs[c] = [*messages, {"role": "assistant", "content": reply.text}]
        state.history += [prompt, acct.render(state.convs[c], generation_prompt=False)]
        n_prompt = reply.prompt_tokens if reply.prompt_tokens is not None else len(prompt)
        results.append(TurnResult(c, t, reply.ttft, n_prompt, can_reuse, reused))
    return results


def _gateway_stats(base: str) -> str:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        stats = httpx.get(base + "/debug/prefix-cache", timeout=30.0).json().get("stats", {})
        return "trie: " + ", ".join(f"{k}={v}" for k, v in stats.items())
    return ""


def bench_server(
    spec: ServerSpec, port: int, work: Workload, acct: Accountant, logdir: Path
) -> ServerResult:
    log = logdir / f"{spec.name}.log"
    load_before = os.getloadavg()[0]
    print(f"[{spec.name}] starting: log {log}", file=sys.stderr, flush=True)
    try:
        with running(spec, port, log) as base:
            turns = replay(base, spec, work, acct, log)
            extra = _gateway_stats(base) if spec.name.startswith("gateway") else ""
    except Exception as exc:  # report any failure in the table and go on with the next server
        print(f"[{spec.name}] failed: {exc}", file=sys.stderr, flush=True)
        return ServerResult(spec.name, spec.note, error=_one_line(exc))
    total = sum(t.ttft for t in turns)
    print(f"[{spec.name}] done: total TTFT {total:.2f}s", file=sys.stderr, flush=True)
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    return ServerResult(spec.name, spec.note, tuple(turns), extra=extra, load=load)


# ---------------------------------------------------------------- peers' setup
def mlx_folder(gguf: Path, alias: str, acct: Accountant) -> Path:
    """Our loader's float32 weights as a HF folder (bench/decode.py writes it), plus the
    tokenizer files mlx-lm's loader needs, offline. A HF folder serves as it is."""
    from gateway.cli.store.store import gateway_home

    if gguf.is_dir():
        return gguf

    folder = gateway_home() / "bench" / f"{alias}-float32"
    if not (folder / "model.safetensors").exists():
        cmd = [sys.executable, str(ROOT / "bench" / "decode.py"), "--worker", "export"]
        subprocess.run([*cmd, str(gguf), str(folder), "float32"], check=True, timeout=900, cwd=ROOT)
    acct.tok.hf.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": acct.tok.bos_token,
        "eos_token": acct.tok.eos_token,
        "add_bos_token": acct.tok.add_bos,
        "chat_template": acct.chat_template,
        "model_max_length": acct.context_length,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


# ---------------------------------------------------------------- report
@dataclass(frozen=True)
class Summary:
    total: float
    first_mean: float
    later_mean: float
    reused: int | None
    computed: int | None
    reusable: int

    @classmethod
    def of(cls, turns: Sequence[TurnResult]) -> Summary:
        first = [t.ttft for t in turns if t.turn == 0]
        later = [t.ttft for t in turns if t.turn > 0]
        known = all(t.reused is not None for t in turns)
        reused = sum(t.reused or 0 for t in turns) if known else None
        prompts = sum(t.prompt_tokens for t in turns)
        return cls(
            total=sum(t.ttft for t in turns),
            first_mean=sum(first) / max(len(first), 1),
            later_mean=sum(later) / max(len(later), 1),
            reused=reused,
            computed=None if reused is None else prompts - reused,
            reusable=sum(t.reusable for t in turns),
        )


def _ratio(a: Summary | None, b: Summary | None) -> str:
    return f"{a.total / b.total:.2f}x" if a and b and b.total > 0 else "n/a"


def _print_summary(results: Sequence[ServerResult]) -> None:
    sums = {r.name: Summary.of(r.turns) for r in results if r.error is None}
    off, mlx = sums.get("gateway-nocache"), sums.get("mlx-lm")
    print(
        "| server | how | total TTFT s | mean TTFT turn 1 s | mean TTFT later s "
        "| reused tok | computed tok | reused / reusable | vs cache off | vs mlx-lm server | load avg |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = sums.get(r.name)
        if s is None:
            print(f"| {r.name} | {r.note} | failed: {r.error} | | | | | | | | |")
            continue
        share = f"{s.reused / s.reusable:.1%}" if s.reused is not None and s.reusable else "n/a"
        reused = "n/a" if s.reused is None else str(s.reused)
        computed = "n/a" if s.computed is None else str(s.computed)
        print(
            f"| {r.name} | {r.note} | {s.total:.2f} | {s.first_mean:.3f} | {s.later_mean:.3f} "
            f"| {reused} | {computed} | {share} | {_ratio(s, off)} | {_ratio(s, mlx)} | {r.load} |"
        )
    _print_verdict(sums.get("gateway"), off, mlx)


def _print_verdict(gw: Summary | None, off: Summary | None, mlx: Summary | None) -> None:
    def check(label: str, value: float | None, target: float, *, at_most: bool) -> None:
        if value is None:
            print(f"- {label}: n/a (a run is missing)")
            return
        ok = value <= target if at_most else value >= target
        sign = "<=" if at_most else ">="
        print(f"- {label}: {value:.3f} (target {sign} {target}) {'PASS' if ok else 'FAIL'}")

    print()
    vs_off = gw.total / off.total if gw and off and off.total else None
    vs_mlx = gw.total / mlx.total if gw and mlx and mlx.total else None
    share = gw.reused / gw.reusable if gw and gw.reused is not None and gw.reusable else None
    check("gateway / gateway-nocache total TTFT", vs_off, TARGET_VS_OFF, at_most=True)
    check("gateway / mlx-lm server total TTFT", vs_mlx, TARGET_VS_MLX, at_most=True)
    check("gateway reused / reusable tokens", share, TARGET_REUSE, at_most=False)


def _print_turns(results: Sequence[ServerResult]) -> None:
    done = [r for r in results if r.error is None]
    if not done:
        return
    print("\nper request: TTFT s (reused tokens as the server reports them / reusable)")
    print("| conv | turn | prompt tok | " + " | ".join(r.name for r in done) + " |")
    print("|---:|---:|---:|" + "---:|" * len(done))
    for i, base in enumerate(done[0].turns):
        cells = []
        for r in done:
            t = r.turns[i]
            reused = "n/a" if t.reused is None else str(t.reused)
            cells.append(f"{t.ttft:.3f} ({reused}/{t.reusable})")
        print(
            f"| {base.conv + 1} | {base.turn + 1} | {base.prompt_tokens} | "
            + " | ".join(cells)
            + " |"
        )
    for r in done:
        if r.extra:
            print(f"\n{r.name} {r.extra}")


# ---------------------------------------------------------------- main
def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="store alias, GGUF file or HF folder (e.g. bench/real_shapes.py's)",
    )
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=20)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--fixture", default=None, help=f"client request JSON (default {FIXTURE})")
    p.add_argument(
        "--quick", action="store_true", help="2 conversations x 2 turns, 600-token system"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.max_tokens = 2, 2, 600, 8
    return args


def _spec(
    name: str, port: int, gguf: Path, args: argparse.Namespace, acct: Accountant, n: int
) -> ServerSpec:
    if name == "mlx-lm":
        return _mlx_spec(mlx_folder(gguf, args.model, acct), port, n)
    if name == "llama.cpp":
        if gguf.is_dir():
            raise ValueError("llama.cpp serves GGUF files only; this model is a HF folder")
        return _llama_spec(gguf, port, acct.context_length)
    return _gateway_spec(name, args.model, port)


def run_all(
    args: argparse.Namespace, gguf: Path, acct: Accountant, work: Workload
) -> list[ServerResult]:
    logdir = Path(tempfile.mkdtemp(prefix="agent_replay_"))  # kept: the servers' logs
    results = []
    for name in [s for s in SERVERS if s in args.servers]:
        port = _free_port()
        try:
            spec = _spec(name, port, gguf, args, acct, len(work.order()))
        except Exception as exc:  # a peer that cannot be set up is reported, not fatal
            results.append(ServerResult(name, "setup", error=_one_line(exc)))
            continue
        results.append(bench_server(spec, port, work, acct, logdir))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    args = _args(argv)
    from gateway.cli.store.store import Store

    gguf = Store().resolve(args.model)
    acct = Accountant(gguf)
    fixture = _find_fixture(args.fixture)
    work = Workload(
        system_text(acct, fixture, args.system_tokens),
        args.conversations,
        args.turns,
        args.max_tokens,
    )
    results = run_all(args, gguf, acct, work)
    print(
        f"\n{args.model}: {args.conversations} conversations x {args.turns} turns interleaved, "
        f"system prompt + tools {acct.count(work.system)} tokens "
        f"({fixture.name if fixture else 'synthetic'}), {args.max_tokens} new tokens per turn, "
        f"greedy, streaming\n"
    )
    _print_summary(results)
    _print_turns(results)


if __name__ == "__main__":
    main()
