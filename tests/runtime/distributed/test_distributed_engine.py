"""The lockstep engine (runtime/distributed) serves as one process does, for every
architecture, tensor and pipeline parallel, over 2 processes (and over 4 for one model
per kind of cache: FOUR_RANKS).

One group per size (ring backend, loopback, started as `mlx.launch` starts them:
tests/support/ring_launch.py) runs tests/support/distributed_engine_worker.py: for
each tiny random model (llama, qwen2, qwen3, gemma3 text with its sliding window,
qwen3_moe, glm4_moe, deepseek_v3's MLA, qwen3_next, qwen3_5 and qwen3_5_moe hybrids)
and each mode, every rank loads its part and serves as `mlx-gateway serve
--distributed` does: rank 0 an Engine whose LockstepRunner leads, the
others follow. Rank 0 submits the same greedy requests the single-process Engine got
(same runner settings): five at once with mixed prompt lengths (the batch, prefills in
chunks and riding on decode steps, a one-token prompt), one of them cancelled after two
tokens and one sharing a prefix with another (the trie hits); then a conversation goes
on and a prompt comes again. Each request's tokens, ending, token counts and cached
tokens equal the single process's (the cancelled one's tokens as far as both ran), so
do the prefix trie's hit counts, and no rank's state ever drifted from rank 0's (the
group checks that every round, and every follower ends cleanly).

HTTP on top is tests/gateway/test_distributed_serve.py's (one model, two ranks): here the
engine alone, so that every architecture fits in the time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.distributed.test_distributed_shard import launch_workers, save_every_architecture

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "support" / "distributed_engine_worker.py"
MODES = ("tensor", "pipeline")
LAUNCH_TIMEOUT = 900  # a hang guard: four ranks share the cores with the other test worker
# What four ranks add to two here is more than one follower and pipeline stages in the
# middle; each architecture's own sharding over four ranks is test_distributed_shard's
# [4]. So four ranks run one model per kind of cache a middle stage carries: plain KV,
# a sliding window, MLA's latent cache, a hybrid's recurrent state, and MoE experts.
FOUR_RANKS = ("qwen3", "gemma3_text", "deepseek_v3", "qwen3_5_moe")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny model saved as a checkpoint, with the single-process engine's results."""
    from tests.support.distributed_engine_worker import single_process

    def reference(loaded: Any, folder: Path) -> None:
        (folder / "reference.json").write_text(
            json.dumps({**single_process(loaded), "modes": MODES})
        )

    return save_every_architecture(tmp_path_factory.mktemp("distributed_engine"), reference)


def _same_requests(got: dict[str, Any], want: dict[str, Any], label: str) -> None:
    """Every request as the single process served it; a cancelled one's tokens as far
    as both ran (where the client's cancel lands is a matter of timing)."""
    assert sorted(got) == sorted(want), label
    for name, expected in want.items():
        result = dict(got[name])
        assert result["error"] is None, f"{label} {name}: {result['error']}"
        if expected["reason"] == "cancelled":
            assert result["reason"] == "cancelled", f"{label} {name}"
            ran = min(len(result["tokens"]), len(expected["tokens"]))
            assert ran >= 2 and result["tokens"][:ran] == expected["tokens"][:ran], (
                f"{label} {name}: {result['tokens']} vs {expected['tokens']}"
            )
            assert result["completion"] == len(result["tokens"]), f"{label} {name}"
            keep = ("prompt", "cached")
            result = {k: result[k] for k in keep}
            expected = {k: expected[k] for k in keep}
        assert result == expected, f"{label} {name}"


@pytest.mark.parametrize("size", [2, 4])
def test_every_architecture_generates_as_one_process(
    size: int, cases: Path, tmp_path: Path
) -> None:
    if size == 4:
        chosen = tmp_path / "cases"
        chosen.mkdir()
        for name in FOUR_RANKS:
            (chosen / name).symlink_to(cases / name, target_is_directory=True)
        cases = chosen
    output = launch_workers(size, WORKER, cases, tmp_path, LAUNCH_TIMEOUT)
    missing = [r for r in range(size) if not (tmp_path / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} of {size} wrote no report:\n{output[-4000:]}"
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]
    assert [(r["rank"], r["size"]) for r in reports] == [(r, size) for r in range(size)]
    names = sorted(p.name for p in cases.iterdir() if p.is_dir())
    expected_runs = [(name, mode) for name in names for mode in MODES]
    for report in reports:
        runs = [(r["case"], r["mode"]) for r in report["results"]]
        assert runs == expected_runs, f"rank {report['rank']}:\n{output[-4000:]}"
    for follower in reports[1:]:
        for result in follower["results"]:
            assert result["code"] == 0, f"{result} rank {follower['rank']}"
    for result in reports[0]["results"]:
        label = f"{result['case']} {result['mode']} over {size}"
        reference = json.loads((cases / result["case"] / "reference.json").read_text())
        assert result["lost"] is None, f"{label}: {result['lost']}"
        _same_requests(result["requests"], reference["requests"], label)
        assert result["prefix"] == reference["prefix"], label
        assert result["prefix"]["hits"] >= 3, label  # branch, continued, again
        assert result["max_batch_seen"] > 1, label  # they did run together
        if reference["fusable"]:
            assert result["fused_steps"] > 0, label
