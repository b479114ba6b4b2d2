"""Embeddings per second: the gateway's /v1/embeddings against sentence-transformers on
PyTorch (CPU) and llama.cpp's embedding mode, all-MiniLM-L6-v2, in one run (issue 30).

1,000 sentences of 5-60 words (seeded), embedded

1. by the gateway (`mlx-gateway serve --model all-minilm-l6-v2`, its own process on
   127.0.0.1), sent as one request of 1,000 inputs, and as 1,000 concurrent single-input
   requests (every request in flight at once, each on its own connection, from a lean
   asyncio client: httpx's own cost per request is about the server's); base64, as the
   OpenAI SDK asks. The encoder's cache of recent embeddings is defeated: each round's sentences
   carry a round tag, so nothing is served from it;
2. by sentence-transformers in this process: `encode(sentences)` (batches of 32, its
   default) and one `encode([s])` per sentence (on the first --single-sample sentences:
   its per-call cost makes 1,000 calls take minutes on a busy machine), on torch's
   threads (all cores); with --gguf FILE, by llama.cpp the same two ways
   (llama-cpp-python, `Llama(FILE, embedding=True)`, all cores, batches of --llama-batch
   tokens): `embed(sentences)` and one `embed(s)` per sentence. FILE is llama.cpp's own
   conversion: `pip download --no-deps --no-binary :all: llama-cpp-python`, unpack it, and
   in its vendor/llama.cpp run `PYTHONPATH=gguf-py:. python convert_hf_to_gguf.py FOLDER
   --outtype f32 --outfile all-minilm-l6-v2-f32.gguf` (FOLDER: the store's model);
3. with --chat ALIAS: that chat model's stream (greedy, --chat-tokens) alone, and beside
   a 1,000-input embedding request on the same server: its decode tokens/s and gaps
   while the request runs (bench/_embed_interference.py).

Each is run --rounds times alternating, the best round kept (the machine may be shared:
the ratios measured in the same run are the result). The one-request vectors are compared
with sentence-transformers' (the worst cosine is printed; tests hold it >= 0.9999).

Target (issue 30): gateway >= 1.0x sentence-transformers, both ways of sending.

    python bench/embeddings.py [--sentences 1000] [--rounds 3] [--single-sample 100]
        [--gguf all-minilm-l6-v2-f32.gguf] [--llama-batch 512] [--llama-threads N]
        [--chat smollm2-135m] [--chat-tokens 400] [--json out.json]

The model comes from `mlx-gateway pull all-minilm-l6-v2`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import bench._embed_interference as interference  # noqa: E402
from bench._servers import ServerSpec, _free_port, running  # noqa: E402

ALIAS = "all-minilm-l6-v2"
WORDS = [
    "agent",
    "memory",
    "search",
    "file",
    "note",
    "project",
    "meeting",
    "budget",
    "river",
    "mountain",
    "city",
    "train",
    "question",
    "answer",
    "model",
    "vector",
    "server",
    "client",
    "request",
    "response",
    "python",
    "function",
    "error",
    "yesterday",
    "tomorrow",
    "quickly",
    "slowly",
    "important",
    "small",
    "large",
    "new",
    "old",
    "first",
    "last",
    "every",
    "the",
    "a",
    "of",
    "to",
    "in",
    "on",
    "for",
    "with",
    "and",
    "or",
    "not",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "this",
    "that",
    "these",
    "those",
    "remember",
    "find",
    "compare",
    "rank",
    "write",
    "read",
    "send",
    "open",
    "close",
    "build",
    "test",
    "deploy",
    "review",
]


def sentences(count: int, seed: int = 30) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(5, 61)))
        out.append(" ".join(str(w) for w in words).capitalize() + ".")
    return out


def _vectors(body: dict[str, Any]) -> np.ndarray:
    rows = sorted(body["data"], key=lambda d: d["index"])
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in rows])


def one_request(base: str, texts: Sequence[str]) -> np.ndarray:
    body = {"model": ALIAS, "input": list(texts), "encoding_format": "base64"}
    r = httpx.post(f"{base}/v1/embeddings", json=body, timeout=600)
    r.raise_for_status()
    return _vectors(r.json())


async def _post(host: str, port: int, path: str, payload: bytes) -> bytes:
    """One POST on a connection of its own, read to its end: a lean HTTP/1.1 client, so
    the client's own cost (httpx spends milliseconds a request, on the same cores as
    the server) stays out of the server's measurement."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        writer.write(head.encode("ascii") + payload)
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    if b" 200 " not in status_line:
        raise RuntimeError(f"{status_line.decode()}: {rest[-300:]!r}")
    return rest.partition(b"\r\n\r\n")[2]


def concurrent_requests(base: str, texts: Sequence[str]) -> np.ndarray:
    """Every text as its own request, all in flight at once."""
    url = httpx.URL(base)
    host, port = str(url.host), int(url.port or 80)

    async def main() -> list[np.ndarray]:
        async def one(text: str) -> np.ndarray:
            body = {"model": ALIAS, "input": text, "encoding_format": "base64"}
            raw = await _post(host, port, "/v1/embeddings", json.dumps(body).encode())
            return _vectors(json.loads(raw))[0]

        return list(await asyncio.gather(*(one(t) for t in texts)))

    return np.stack(asyncio.run(main()))


def timed(run: Callable[[], np.ndarray]) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    out = run()
    return time.perf_counter() - started, out


def _one_by_one(st: Any, texts: Sequence[str]) -> np.ndarray:
    return np.stack([st.encode([s])[0] for s in texts])


def _llama(path: Path, batch: int, threads: int | None) -> Any:
    """llama.cpp's embedding mode (llama-cpp-python), on all cores unless told."""
    import os

    from llama_cpp import Llama

    cores = threads or os.cpu_count() or 1
    return Llama(
        str(path), embedding=True, n_ctx=batch, n_batch=batch, n_ubatch=batch,
        n_threads=cores, n_threads_batch=cores, verbose=False,
    )  # fmt: skip


def _llama_batch(llm: Any, texts: Sequence[str]) -> np.ndarray:
    return np.asarray(llm.embed(list(texts), normalize=True), dtype=np.float32)


def _llama_one_by_one(llm: Any, texts: Sequence[str]) -> np.ndarray:
    return np.stack([np.asarray(llm.embed(s, normalize=True), dtype=np.float32) for s in texts])


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-sample", type=int, default=100)
    parser.add_argument("--gguf", type=Path, help="llama.cpp's GGUF of the model: measure it too")
    # a ubatch attends over all its tokens (masked): 2048 ran 3x slower than 512 here
    parser.add_argument("--llama-batch", type=int, default=512, help="llama.cpp's batch tokens")
    parser.add_argument("--llama-threads", type=int, help="llama.cpp's threads (all cores)")
    parser.add_argument("--chat", help="also: this chat model's stream beside an embedding request")
    parser.add_argument("--chat-tokens", type=int, default=400)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from gateway.cli.store.store import Store  # the store, without loading MLX here

    folder = Store().resolve(ALIAS)
    import torch
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    llm = _llama(args.gguf, args.llama_batch, args.llama_threads) if args.gguf else None
    port = _free_port()
    cmd = (sys.executable, "-m", "gateway.cli.main", "serve", "--model", ALIAS,
           "--host", "127.0.0.1", "--port", str(port))  # fmt: skip
    spec = ServerSpec("gateway", "f32 + BLAS", cmd, ALIAS, "/health")
    best: dict[str, float] = {}  # embeddings/s
    worst: dict[str, float] = {}  # cosine against sentence-transformers
    with tempfile.TemporaryDirectory() as tmp, running(spec, port, Path(tmp) / "gw.log") as base:
        one_request(base, ["warm up the encoder"])  # loads the model
        for r in range(args.rounds):
            texts = [f"{s} (round {r})" for s in sentences(args.sentences)]
            reference = st.encode(texts)
            singles = [f"{s}!" for s in texts]  # not in the encoder's cache of recent rows
            sample = texts[: args.single_sample]  # torch's per-call cost: 1,000 take minutes
            runs: dict[str, Callable[[], np.ndarray]] = {
                "gateway, one request": partial(one_request, base, texts),
                "gateway, concurrent singles": partial(concurrent_requests, base, singles),
                "sentence-transformers, encode(batch 32)": partial(st.encode, texts),
                "sentence-transformers, one at a time": partial(_one_by_one, st, sample),
            }
            if llm is not None:
                runs["llama.cpp, embed(batch)"] = partial(_llama_batch, llm, texts)
                runs["llama.cpp, one at a time"] = partial(_llama_one_by_one, llm, sample)
            for name, run in runs.items():
                seconds, vectors = timed(run)
                rate = len(vectors) / seconds
                best[name] = max(best.get(name, 0.0), rate)
                if name in ("gateway, one request", "llama.cpp, embed(batch)"):
                    cosine = float(_cosines(vectors, reference).min())
                    worst[name] = min(worst.get(name, 1.0), cosine)
                print(f"round {r + 1}: {name}: {rate:.1f}/s", flush=True)
    _table(args, best, worst, torch.get_num_threads())
    result: dict[str, Any] = {"rates": best, "worst_cosine": worst}
    if args.chat:
        result["chat"] = _chat_part(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _table(
    args: argparse.Namespace, rates: dict[str, float], worst: dict[str, float], threads: int
) -> None:
    peers = {"sentence-transformers": rates["sentence-transformers, encode(batch 32)"]}
    if "llama.cpp, embed(batch)" in rates:
        peers["llama.cpp"] = rates["llama.cpp, embed(batch)"]
    print(f"\nall-MiniLM-L6-v2, {args.sentences} sentences of 5-60 words, best of "
          f"{args.rounds} (torch threads {threads})\n")  # fmt: skip
    print("| way | embeddings/s | " + " | ".join(f"vs {p} batch" for p in peers) + " |")
    print("|---|---:|" + "---:|" * len(peers))
    for name, rate in rates.items():
        ratios = " | ".join(f"{rate / peer:.2f}x" for peer in peers.values())
        print(f"| {name} | {rate:.1f} | {ratios} |")
    for name, cosine in worst.items():
        print(f"worst cosine, {name} against sentence-transformers: {cosine:.6f}")


def _chat_part(args: argparse.Namespace) -> dict[str, float]:
    """A chat stream alone and beside a 1,000-input embedding request, on one server."""
    port = _free_port()
    cmd = (sys.executable, "-m", "gateway.cli.main", "serve", "--model", args.chat,
           "--model", ALIAS, "--host", "127.0.0.1", "--port", str(port))  # fmt: skip
    spec = ServerSpec("gateway", "f32 + BLAS", cmd, args.chat, "/health")
    with tempfile.TemporaryDirectory() as tmp, running(spec, port, Path(tmp) / "gw.log") as base:
        one_request(base, ["warm up the encoder"])
        texts = [f"{s} (beside a chat stream)" for s in sentences(args.sentences)]
        out = interference.measure(
            base, args.chat, args.chat_tokens, partial(one_request, base), texts
        )
    print(f"\n{args.chat} streaming ({args.chat_tokens} tokens at most) beside a "
          f"{args.sentences}-input embedding request:\n")  # fmt: skip
    print("| measure | value |")
    print("|---|---:|")
    for name, value in out.items():
        print(f"| {name} | {value:.1f} |")
    return out


if __name__ == "__main__":
    sys.exit(main())
