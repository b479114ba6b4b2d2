"""Speculative decoding, side by side in one run: decode speed with speculation off, with
prompt lookup, with the trie drafter (other conversations' text too), with the file
passed as a predicted output, and llama.cpp with and
without its prompt lookup (llama-cpp-python's LlamaPromptLookupDecoding) on the same
GGUF and the same token ids, greedy.

Tasks (Qwen2.5-Coder-0.5B by default):
  edit     a 300-line source file read by a tool, asked back whole with one function
           renamed (the file is the prediction)
  quote    a tool call that quotes a long path and an old string from its context
  free     free chat with nothing to copy
  edit x8  eight streams of `edit` at once (aggregate tokens/s)

Every configuration's output is compared with speculation off: they must be the same
tokens. Printed: decode tokens/s (after the first token), the ratio to speculation off,
and the share of drafted tokens accepted.

    python bench/speculative.py [--model PATH.gguf] [--tokens 300] [--skip-llama]
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime import backend  # noqa: E402

backend.configure()

from gateway.core.models.build import model_controls  # noqa: E402
from runtime.engine import Engine, ModelRunner  # noqa: E402
from runtime.engine.runner import RunnerSettings  # noqa: E402
from runtime.load import load  # noqa: E402
from runtime.load.loaded import LoadedModel  # noqa: E402
from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta  # noqa: E402
from templates import render_prompt, renderer_for  # noqa: E402
from templates.types import Message, RenderOptions, Tool, ToolCall  # noqa: E402

MODEL = (
    Path.home()
    / ".cache/mlx-gateway/models/qwen2.5-coder-0.5b/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
)
READ = Tool(
    "read_file", "Read a file", {"type": "object", "properties": {"path": {"type": "string"}}}
)
EDIT = Tool("edit_file", "Replace old_string by new_string in a file", {
    "type": "object",
    "properties": {"path": {"type": "string"}, "old_string": {"type": "string"},
                   "new_string": {"type": "string"}},
})  # fmt: skip


def _source() -> str:
    """300 lines of a real Python module (the standard library's textwrap)."""
    lines = Path(textwrap.__file__).read_text().splitlines()
    return "\n".join(lines[:300]) + "\n"


def _tasks() -> dict[str, tuple[tuple[Message, ...], tuple[Tool, ...], str | None]]:
    source = _source()
    path = "src/vendor/python3.11/lib/textwrap/textwrap_compat_layer_for_legacy_callers.py"
    call = ToolCall("c1", "read_file", json.dumps({"path": path}))
    read = (
        Message("user", f"Open {path}."),
        Message("assistant", None, tool_calls=(call,)),
        Message("tool", source, tool_call_id="c1"),
    )
    renamed = source.replace("def _split_chunks", "def _split_into_chunks").replace(
        "self._split_chunks", "self._split_into_chunks"
    )
    edit = (*read, Message("user", "Rename the method _split_chunks to _split_into_chunks. "
                           "Write the whole file back, changed, and nothing else."))  # fmt: skip
    quote = (*read, Message("user", "In that file, change the default width from 70 to 100 "
                            "in TextWrapper.__init__ with the edit_file tool, quoting the "
                            "whole old signature line."))  # fmt: skip
    free = (Message("user", "Write a short story about a lighthouse keeper who learns to "
                    "paint. Make it vivid and original."),)  # fmt: skip
    return {"edit": (edit, (READ,), renamed), "quote": (quote, (READ, EDIT), None),
            "free": (free, (), None)}  # fmt: skip


def _prompt(
    loaded: LoadedModel, messages: tuple[Message, ...], tools: tuple[Tool, ...]
) -> list[int]:
    tok = loaded.tokenizer
    renderer = renderer_for(
        loaded.chat_template, bos_token=tok.bos_token, eos_token=tok.eos_token,
        model_type=str(loaded.config.get("model_type")),
    )  # fmt: skip
    rendered = render_prompt(renderer, messages, tools, RenderOptions(), model_controls(loaded))
    return tok.encode_prompt(rendered.text, content=rendered.content)


def _run(engine: Engine, requests: list[GenerationRequest]) -> list[tuple[list[int], Finished]]:
    out: list[Any] = [None] * len(requests)

    def one(i: int) -> None:
        tokens: list[int] = []
        for event in engine.submit(requests[i]):
            if isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                out[i] = (tokens, event)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _gateway(
    loaded: LoadedModel, mode: str, jobs: dict[str, list[GenerationRequest]]
) -> dict[str, Any]:
    # the prefix cache on: eight streams of one prompt read it once, as a server would
    runner = ModelRunner(loaded, RunnerSettings(speculative=mode, max_batch=8))
    engine = Engine(runner, max_queue=64)
    engine.start()
    try:
        _run(engine, [GenerationRequest(tuple(range(100, 140)), 8)])  # warm up
        results = {}
        for name, requests in jobs.items():
            began = time.perf_counter()
            done = _run(engine, requests)
            wall = time.perf_counter() - began
            stats = [d.stats for _, d in done]
            decoded = sum(max(0, s.completion_tokens - 1) for s in stats)
            # one stream: its own decode time; several: decoded tokens over the wall time
            # from the first one's first token to the last one's end
            seconds = stats[0].decode_seconds if len(stats) == 1 else wall - min(
                s.prefill_seconds for s in stats)  # fmt: skip
            drafted = sum(s.drafted_tokens for s in stats)
            print(f"  {mode} {name}: {decoded} tokens in {seconds:.1f} s", flush=True)
            results[name] = {
                "tps": decoded / seconds if seconds > 0 else 0.0,
                "accepted": sum(s.accepted_tokens for s in stats) / drafted if drafted else None,
                "tokens": [t for t, _ in done],
            }
        return results
    finally:
        engine.stop()


def _llama(path: Path, jobs: dict[str, list[GenerationRequest]], lookup: bool) -> dict[str, Any]:
    import llama_cpp  # the peer, only here
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    # a draft model needs every position's logits (llama-cpp-python verifies on the host)
    llm = llama_cpp.Llama(
        str(path), n_ctx=8192, n_threads=2, verbose=False, draft_model=draft, logits_all=lookup
    )
    results = {}
    for name, requests in jobs.items():
        if len(requests) > 1:
            continue  # one sequence at a time in llama-cpp-python
        req = requests[0]
        llm.reset()
        tokens: list[int] = []
        first = 0.0
        for token in llm.generate(list(req.prompt_tokens), top_k=1, temp=0.0, repeat_penalty=1.0):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= req.max_tokens or token == llm.token_eos():
                break
        seconds = time.perf_counter() - first
        print(f"  llama.cpp{' lookup' if lookup else ''} {name}: {len(tokens)} tokens in "
              f"{seconds:.1f} s", flush=True)  # fmt: skip
        results[name] = {"tps": (len(tokens) - 1) / seconds, "accepted": None, "tokens": [tokens]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    loaded = load(args.model)
    tok = loaded.tokenizer
    greedy = SamplingParams(temperature=0.0)
    plain: dict[str, list[GenerationRequest]] = {}
    predicted: dict[str, list[GenerationRequest]] = {}
    for name, (messages, tools, prediction) in _tasks().items():
        ids = tuple(_prompt(loaded, messages, tools))
        req = GenerationRequest(ids, args.tokens, greedy)
        plain[name] = [req]
        if prediction is not None:
            pred = tuple(tok.encode(prediction, add_special_tokens=False))
            predicted[name] = [GenerationRequest(ids, args.tokens, greedy, prediction=pred)]
    plain["edit x8"] = plain["edit"] * 8
    predicted["edit x8"] = predicted["edit"] * 8
    print(f"model {args.model.name}; prompts: " + ", ".join(
        f"{n} {len(r[0].prompt_tokens)} tokens" for n, r in plain.items() if n != "edit x8"), flush=True)  # fmt: skip
    columns: dict[str, dict[str, Any]] = {}
    columns["off"] = _gateway(loaded, "off", plain)
    columns["lookup"] = _gateway(loaded, "lookup", plain)
    columns["trie"] = _gateway(loaded, "trie", plain)
    columns["prediction"] = _gateway(loaded, "off", predicted)
    if not args.skip_llama:
        columns["llama.cpp"] = _llama(args.model, plain, lookup=False)
        columns["llama.cpp lookup"] = _llama(args.model, plain, lookup=True)
    base = columns["off"]
    print()
    print("| task | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for task in plain:
        cells = []
        for name, col in columns.items():
            got = col.get(task)
            if got is None:
                cells.append("-")
                continue
            ratio = got["tps"] / base[task]["tps"] if base[task]["tps"] else 0.0
            same = all(a == b for a, b in zip(got["tokens"], base[task]["tokens"], strict=False))
            acc = "" if got["accepted"] is None else f", {got['accepted']:.0%} acc"
            mark = "" if same or name.startswith("llama") else " DIFFERS"
            cells.append(f"{got['tps']:.1f} ({ratio:.2f}x{acc}){mark}")
        print(f"| {task} | " + " | ".join(cells) + " |")
    print(
        "\ntokens/s of decode after the first token (edit x8: aggregate); ratio to "
        "speculation off; acc = drafted tokens accepted. llama.cpp rows: the same token "
        "ids, greedy, 2 threads; its outputs are its own (not compared)."
    )


if __name__ == "__main__":
    main()
