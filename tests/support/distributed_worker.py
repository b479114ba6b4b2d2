"""One rank of tests/runtime/distributed/test_distributed_shard.py, started on every rank by mlx.launch.

    mlx.launch -n N --backend ring ... tests/support/distributed_worker.py CASES OUT [MODE ...]

CASES holds one folder per tiny model, each with its checkpoint and the single-process
run's results (`reference.npz`, `reference.json`, written by `write_reference`, which
also names the modes the case runs in). Every rank loads its part of each model with
`load_sharded` for each of those modes, runs the same script as the reference
(`run_script`) and writes what it saw to OUT/rank<r>.json:
the largest logit difference from the reference, its parameter and cache bytes, how many
caches `make_caches` gave and the communication volume per token.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root holds `runtime`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runtime import backend

backend.configure()  # the optimized BLAS, before mlx is imported

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from runtime.cache.batch import BatchCaches  # noqa: E402
from runtime.cache.ragged import RaggedCache  # noqa: E402
from runtime.distributed import Group, Mode, comm_bytes_per_token, load_sharded, shard_info  # noqa: E402
from runtime.distributed.pipeline import parameter_bytes  # noqa: E402
from runtime.load.loaded import LoadedModel  # noqa: E402
from runtime.models.base import LanguageModel, fusable  # noqa: E402

MODES: tuple[Mode, ...] = ("tensor", "pipeline")
# a prompt longer than gemma3's tiny sliding window (8), in two prefill chunks, then
# decode steps with fixed tokens, then a batch of two rows without caches (run_script)
PROMPT = [5, 17, 300, 41, 9, 1000, 77, 3, 512, 64, 128, 900]
FIRST_CHUNK = 7
DECODE = [33, 250]
# 2 rows x 16 tokens x top-2 experts: enough (token, expert) pairs for the sorted path
BATCH = [list(range(11, 27)), list(range(900, 740, -10))]
BATCH_DECODE = [[21, 22], [23, 24]]
RIDER = [40, 41, 42, 43, 44]


def run_script(model: LanguageModel) -> tuple[list[np.ndarray[Any, Any]], list[Any]]:
    """Logits of what the engine runs, and the caches the first sequence filled:

    1. a prompt in two prefill chunks, the first evaluated through its caches only, as
       the engine's prefill does (a pipeline stage must still hand its activations on);
       the second chunk's logits at every position;
    2. decode steps with fixed tokens;
    3. a batch of two rows without caches;
    4. that sequence and a second one joined in a batch (left-padded caches, one offset
       a row) for batched decode steps, and for models whose steps fuse, a decode step
       with a third sequence's prefill chunk riding on it (runtime/cache/ragged.py).
    """
    outs: list[mx.array] = []

    def step(tokens: list[list[int]], caches: Any) -> None:
        outs.append(model.logits(model.forward(mx.array(tokens), caches)))
        mx.eval(outs[-1])

    caches = model.make_caches()
    model.forward(mx.array([PROMPT[:FIRST_CHUNK]]), caches)
    mx.eval([c.state for c in caches])
    step([PROMPT[FIRST_CHUNK:]], caches)
    for token in DECODE:
        step([[token]], caches)
    step(BATCH, None)
    other = model.make_caches()
    model.forward(mx.array([BATCH[1]]), other)
    mx.eval([c.state for c in other])
    batch = BatchCaches(caches)
    batch.add(caches)
    batch.add(other)
    for tokens in BATCH_DECODE:
        step([[t] for t in tokens], batch.layers)
    if fusable(model):
        third = model.make_caches()
        ragged = [RaggedCache(b, p) for b, p in zip(batch.layers, third, strict=True)]
        step([[*BATCH_DECODE[0], *RIDER]], ragged)
    return [np.array(o.astype(mx.float32)) for o in outs], list(caches)


def is_quantized(folder: Path) -> bool:
    return "quantization" in json.loads((folder / "config.json").read_text())


def cache_bytes(caches: list[Any]) -> int:
    return sum(int(c.nbytes) for c in caches)


def write_reference(loaded: LoadedModel, folder: Path, modes: tuple[Mode, ...] = MODES) -> None:
    """The single-process run's logits and sizes, for the ranks to compare with in
    `modes`."""
    model = loaded.model
    outs, caches = run_script(model)
    np.savez(folder / "reference.npz", *outs)
    meta = {
        "parameter_bytes": parameter_bytes(model),
        "cache_bytes": cache_bytes(caches),
        "caches": len(caches),
        "quantized": loaded.quantized,
        "modes": list(modes),
    }
    (folder / "reference.json").write_text(json.dumps(meta))


def _run_case(folder: Path, group: Group, mode: Mode) -> dict[str, Any]:
    gc.collect()  # the previous case's arrays, so that the peak is this load's own
    mx.reset_peak_memory()
    started = time.perf_counter()
    loaded = load_sharded(  # an MLX-quantized folder stays quantized, as on a GPU
        folder, group, mode, dtype="float32", keep_quantized=is_quantized(folder) or None
    )
    load_peak = mx.get_peak_memory()
    model = loaded.model
    outs, caches = run_script(model)
    reference = np.load(folder / "reference.npz")
    expected = [reference[f"arr_{i}"] for i in range(len(reference.files))]
    info = shard_info(model)
    return {
        "case": folder.name,
        "mode": mode,
        "max_diff": max(float(np.abs(a - b).max()) for a, b in zip(outs, expected, strict=True)),
        "shapes_match": all(a.shape == b.shape for a, b in zip(outs, expected, strict=True)),
        "parameter_bytes": parameter_bytes(model),
        "load_peak_bytes": int(load_peak),
        "cache_bytes": cache_bytes(caches),
        "caches": len(caches),
        "quantized": loaded.quantized,
        "fresh_caches": len(model.make_caches()),
        "layers": [info.layers.start, info.layers.stop] if info else None,
        "comm_bytes_per_token": comm_bytes_per_token(model, group, mode),
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str]) -> int:
    cases, out = Path(argv[1]), Path(argv[2])
    modes = [m for m in MODES if m in argv[3:]] or list(MODES)
    group = Group.init("ring")
    results = [
        _run_case(folder, group, mode)
        for folder in sorted(p for p in cases.iterdir() if p.is_dir())
        for mode in modes
        if mode in json.loads((folder / "reference.json").read_text())["modes"]
    ]
    report = {"rank": group.rank, "size": group.size, "describe": group.describe()}
    (out / f"rank{group.rank}.json").write_text(json.dumps({**report, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
