"""Tensor and pipeline parallel (runtime/distributed) across real processes on loopback.

One group per size (2 and 4 ranks, ring backend, started as `mlx.launch` starts them:
tests/support/ring_launch.py) runs tests/support/distributed_worker.py over a tiny
random model of every architecture (and a 4-bit MLX-quantized MoE), saved as a
checkpoint so that `load_sharded` reads real files, and for tensor parallel over models
whose head counts and widths 2 and 4 do not divide
(SmolLM2's 9 heads over 3 key/value heads, Qwen2.5-0.5B's 14 over 2, a delta-net's and
MLA's, a 4-bit one). Each rank, in each mode, compares its logits with the
single-process run's to 1e-4 in float32 (prefill chunks, decode steps, a batch without
caches, batched decode over joined caches, a fused decode + prefill step) and reports
how much of the model, of the caches and of the load's peak memory it holds. The split
rules themselves (who holds which heads, what cannot split, stage balance, the error
messages, communication counts) are checked in-process, and so is each mixer's and
MLP's split over 2 to 5 ranks: the ranks' partial outputs add up to the whole's.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import pytest
from mlx.nn.layers.base import Module
from mlx.nn.layers.quantized import quantize
from mlx.utils import tree_flatten

from runtime.distributed import Group, comm_bytes_per_token, shard_model, split_problems
from runtime.distributed.layers import balanced_range, head_problem, head_ranges, split_heads
from runtime.distributed.pipeline import stage_ranges
from runtime.distributed.tensor import LAYER_PARTS
from runtime.models import build_model
from tests.support.ring_launch import run_ring

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "support" / "distributed_worker.py"
TOLERANCE = 1e-4
LAUNCH_TIMEOUT = 900  # a hang guard, not a bound on speed

# -- the split rules, in-process -------------------------------------------------------------


def test_head_split_even_and_replicated() -> None:
    # 8 query heads over 2 key/value heads: 2 ranks split both, 4 ranks share each
    two = [split_heads(8, 2, 2, r) for r in range(2)]
    assert [(s.heads, s.groups, s.padding) for s in two] == [((0, 4), (0,), 0), ((4, 8), (1,), 0)]
    four = [split_heads(8, 2, 4, r) for r in range(4)]
    assert [s.heads for s in four] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # each rank's query heads read exactly the key/value head it keeps (head // 4)
    assert [s.groups for s in four] == [(0,), (0,), (1,), (1,)]
    assert head_problem(8, 2, 4, ("a", "b")) is None


def test_uneven_heads_split_as_evenly_as_they_go() -> None:
    # SmolLM2-135M: 9 query heads over 3 key/value heads
    assert head_ranges(9, 3, 4, True) == ((0, 3), (3, 5), (5, 7), (7, 9))
    four = [split_heads(9, 3, 4, r) for r in range(4)]
    assert [s.groups for s in four] == [(0,), (1,), (1, 2), (2,)]
    assert all(s.padding == 0 for s in four)
    # over 2 ranks a rank reads 3 heads of one group and 2 of the next: heads of zeros
    # pad the short group, so each rank caches 2 of the 3 key/value heads
    two = [split_heads(9, 3, 2, r) for r in range(2)]
    assert [s.heads for s in two] == [(0, 5), (5, 9)]
    assert [s.slots for s in two] == [(0, 1, 2, 3, 4, None), (5, None, None, 6, 7, 8)]
    assert [s.groups for s in two] == [(0, 1), (1, 2)]
    # the delta-net repeats key heads instead (a value head carries recurrent state)
    delta = split_heads(9, 3, 2, 0, pad=False)
    assert delta.slots == (0, 1, 2, 3, 4) and delta.groups == (0, 0, 0, 1, 1)
    # Qwen2.5-Coder-0.5B: 14 over 2; the larger shares go where no rank straddles a group
    assert head_ranges(14, 2, 4, True) == ((0, 4), (4, 7), (7, 11), (11, 14))
    assert [split_heads(14, 2, 4, r).groups for r in range(4)] == [(0,), (0,), (1,), (1,)]
    # nothing but one head per rank at least is asked
    problem = head_problem(9, 3, 10, ("num_attention_heads", "num_key_value_heads"))
    assert problem and "at most 9 ranks" in problem
    assert balanced_range(91, 4, 0) == (0, 23) and balanced_range(91, 4, 3) == (69, 91)
    assert [balanced_range(160, 4, r, unit=32) for r in range(4)] == [
        (0, 64),
        (64, 96),
        (96, 128),
        (128, 160),
    ]


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize(
    ("heads", "groups"), [(9, 3), (14, 2), (32, 8), (12, 4), (64, 4), (9, 9), (7, 1), (40, 8)]
)
def test_every_head_is_held_once_and_reads_its_group(heads: int, groups: int, pad: bool) -> None:
    per = heads // groups
    for size in range(1, min(heads, 9) + 1):
        splits = [split_heads(heads, groups, size, r, pad=pad) for r in range(size)]
        shares = [s.heads[1] - s.heads[0] for s in splits]
        assert max(shares) - min(shares) <= 1, (heads, groups, size)
        held = [h for s in splits for h in s.slots if h is not None]
        assert held == list(range(heads)), (heads, groups, size)
        for s in splits:
            assert s.head_count == s.group_count * s.repeat
            # grouped-query attention's layout: local head i reads local group i // repeat
            assert all(
                h is None or s.groups[i // s.repeat] == h // per for i, h in enumerate(s.slots)
            )
            assert pad or s.padding == 0
        if heads % size == 0 and (groups % size == 0 or size % groups == 0):
            # the even split: whole groups, or one group, a rank; nothing padded or repeated
            assert all(s.padding == 0 and len(set(s.groups)) == s.group_count for s in splits)


def _smollm_like(**extra: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "hidden_size": 64,
        "head_dim": 16,
        "intermediate_size": 91,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 64,
        **extra,
    }


def _build(config: dict[str, Any], group_size: int | None = None) -> Any:
    """A model of `config` with random weights, 4-bit in groups of `group_size` if set."""
    model = build_model(config)
    if group_size:
        quantize(cast(Module, model), group_size=group_size, bits=4)
    return model


@pytest.mark.parametrize("group_size", [None, 32])
def test_an_even_split_is_plain_slices(group_size: int | None) -> None:
    """Where the counts divide, each rank holds exactly its 1/size slice of every
    weight, as before uneven splits existed: no padding, no repeated heads."""
    config = _smollm_like(
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, intermediate_size=256
    )
    whole = _build(config, group_size)
    weights = tree_flatten(whole.parameters())
    w_attn, w_mlp = whole.model.layers[0].self_attn, whole.model.layers[0].mlp
    for size in (2, 4):
        for rank in range(size):
            part = _rank_part(config, group_size, size, rank, weights)
            attn, mlp = part.model.layers[0].self_attn, part.model.layers[0].mlp
            heads, groups = 8 // size, max(1, 2 // size)
            first_group = rank * 2 // size
            rows = {
                "q": (attn.q_proj, w_attn.q_proj, rank * heads * 32, heads * 32),
                "k": (attn.k_proj, w_attn.k_proj, first_group * 32, groups * 32),
                "gate": (mlp.gate_proj, w_mlp.gate_proj, rank * 256 // size, 256 // size),
            }
            for label, (mine, full, start, count) in rows.items():
                for key, value in full.items():
                    if isinstance(value, mx.array):
                        expected = value[start : start + count]
                        assert mx.array_equal(mine[key], expected).item(), (label, key, size)
            # row-parallel: this rank's 1/size of the input columns (packed alike)
            for mine, full in ((attn.o_proj, w_attn.o_proj), (mlp.down_proj, w_mlp.down_proj)):
                for key in ("weight", "scales", "biases"):
                    if key in full:
                        share = full[key].shape[1] // size
                        expected = full[key][:, rank * share : (rank + 1) * share]
                        assert mx.array_equal(mine[key], expected).item(), (key, size)
            assert attn.n_heads == heads and attn.n_kv_heads == groups


def test_only_what_truly_cannot_split_is_refused() -> None:
    model = build_model(_smollm_like())
    for size in (2, 3, 4, 5, 9):
        assert split_problems(model, size, "tensor") == [], size
    problems = split_problems(model, 10, "tensor")
    assert problems and "num_attention_heads=9" in problems[0]
    assert "at most 9 ranks" in problems[0]
    assert split_problems(model, 2, "pipeline") == []
    assert "2 layers cannot form 4 pipeline stages" in split_problems(model, 4, "pipeline")[0]


def test_quantized_inputs_split_on_whole_groups_or_say_why_not() -> None:
    # 6 heads of 32 over 2 key/value heads, 4-bit in groups of 64: o_proj's 192 inputs
    # are 3 groups, the MLP's 192 too
    config = _smollm_like(
        num_attention_heads=6, num_key_value_heads=2, head_dim=32, intermediate_size=192
    )
    model = _build(config, group_size=64)
    assert split_problems(model, 3, "tensor") == []  # 2 heads, 64 inputs, a rank
    two = split_problems(model, 2, "tensor")  # 3 heads: 96 inputs, a group and a half
    assert len(two) == 1 and "o_proj" in two[0] and "whole quantization groups of 64" in two[0]
    four = split_problems(model, 4, "tensor")
    assert any("o_proj" in p for p in four)
    assert any(
        "intermediate_size 192 has only 3 quantization groups of 64 for 4 ranks" in p for p in four
    )


def test_a_model_that_cannot_split_is_left_whole() -> None:
    model = build_model(
        {
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 6,  # fewer columns than ranks
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 64,
        }
    )
    problems = split_problems(model, 8, "tensor")
    assert any("num_attention_heads=4" in p for p in problems)
    assert any("intermediate_size 6 has only 6 columns for 8 ranks" in p for p in problems)
    before = [type(layer.self_attn.o_proj) for layer in model.model.layers]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown parallel mode"):
        shard_model(model, Group.single(), "data")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        shard_model(model, cast(Any, _Ranks(8, 0)), "tensor")
    assert [type(layer.self_attn.o_proj) for layer in model.model.layers] == before  # type: ignore[attr-defined]


def test_stages_balance_parameter_bytes() -> None:
    assert stage_ranges([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    # a heavy first layer gets a stage of its own
    assert stage_ranges([10, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert stage_ranges([5, 5, 5], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="3 layers cannot form 4 pipeline stages"):
        stage_ranges([1, 1, 1], 4)


def test_one_rank_is_the_whole_model() -> None:
    model = build_model(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "vocab_size": 64,
        }
    )
    tokens = mx.array([[1, 2, 3]])
    before = model(tokens)
    shard_model(model, Group.single(), "tensor")
    assert mx.allclose(model(tokens), before).item()
    assert comm_bytes_per_token(model, Group.single(), "tensor") == 0


class _Ranks:
    """What shard.py reads of a group (size and rank), to count without launching."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _hybrid_config() -> dict[str, Any]:
    """qwen3_next with 9 attention heads over 3 key/value heads and 6 delta-net value
    heads over 3 key heads: uneven over 2 and 4 ranks."""
    transformers = pytest.importorskip("transformers")
    from tests.support import tiny_hybrid

    extra = {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "linear_num_value_heads": 6,
        "linear_num_key_heads": 3,
        "intermediate_size": 91,
        "shared_expert_intermediate_size": 38,
        "full_attention_interval": 2,
    }
    config = {**tiny_hybrid._TEXT, **tiny_hybrid._MOE, **extra}
    return cast(dict[str, Any], transformers.Qwen3NextConfig(**config).to_dict())


def _mla_config() -> dict[str, Any]:
    """deepseek_v3 with 5 heads and odd MLP widths."""
    transformers = pytest.importorskip("transformers")
    from tests.support import tiny_deepseek

    extra = {
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "intermediate_size": 91,
        "moe_intermediate_size": 30,
    }
    config = transformers.DeepseekV3Config(**{**tiny_deepseek._BASE, **extra}).to_dict()
    return cast(dict[str, Any], config)


_PART_CASES: dict[str, Callable[[], tuple[dict[str, Any], int | None]]] = {
    # q/k/v biases over padded heads
    "qwen2_9_heads": lambda: (
        _smollm_like(model_type="qwen2", hidden_size=72, head_dim=8, num_hidden_layers=1),
        None,
    ),
    "qwen2_14_heads": lambda: (
        _smollm_like(
            model_type="qwen2",
            hidden_size=112,
            head_dim=8,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=150,
            num_hidden_layers=1,
        ),
        None,
    ),
    "qwen3_next": lambda: (_hybrid_config(), None),
    "deepseek_v3": lambda: (_mla_config(), None),
    # 4-bit in groups of 32 = head_dim: padded heads are zero groups; 5 MLP groups
    "llama_4bit": lambda: (_smollm_like(head_dim=32, intermediate_size=160), 32),
}


def _rank_part(
    config: dict[str, Any], group_size: int | None, size: int, rank: int, weights: Any
) -> Any:
    """Rank `rank`'s part of the model, its all_sums over a group of one: its output is
    its partial sum, which the ranks' all_sum would add up."""
    part = _build(config, group_size)
    part.load_weights(weights)
    shard_model(part, cast(Any, _Ranks(size, rank)), "tensor")
    single = Group.single().handle
    for _, module in cast(Any, part).named_modules():
        if isinstance(getattr(module, "group", None), _Ranks):
            module.group = single
    return part


def _call(module: Any, attr: str, x: mx.array, cache: Any) -> mx.array:
    return cast(mx.array, module(x) if attr == "mlp" else module(x, cache))


def _parts(model: Any) -> list[tuple[int, str, Any]]:
    """(layer index, attribute, module) of every mixer and MLP."""
    return [
        (index, attr, getattr(layer, attr))
        for index, layer in enumerate(model.model.layers)
        for attr in LAYER_PARTS
        if isinstance(getattr(layer, attr, None), Module)
    ]


@pytest.mark.parametrize("name", sorted(_PART_CASES))
def test_the_ranks_parts_add_up_to_the_whole(name: str) -> None:
    """Every mixer and MLP, split over 2 to 5 ranks: the ranks' partial outputs (what
    their all_sum adds) equal the whole module's, for a prefill and a decode step over
    each rank's own caches. In-process, so sizes the launched test does not run (3, 5)
    and layouts with padding heads, repeated key heads and zero quantization groups are
    all checked in a second."""
    config, group_size = _PART_CASES[name]()
    whole = _build(config, group_size)
    weights = tree_flatten(whole.parameters())
    hidden = int(config["hidden_size"])
    steps = [mx.random.normal((2, 6, hidden), key=mx.random.key(s)) for s in (1, 2)]
    steps[1] = steps[1][:, :1]
    modules = _parts(whole)
    experts = [
        m.switch_mlp.gate_proj["weight"].shape[0] for _, _, m in modules if hasattr(m, "switch_mlp")
    ]
    for size in range(2, min([5, *experts]) + 1):
        ranks = [_rank_part(config, group_size, size, r, weights) for r in range(size)]
        whole_caches = whole.make_caches()
        rank_caches = [p.make_caches() for p in ranks]
        rank_modules = [_parts(p) for p in ranks]
        for x in steps:
            for i, (index, attr, module) in enumerate(modules):
                expected = _call(module, attr, x, whole_caches[index])
                got = sum(
                    _call(mods[i][2], attr, x, caches[index])
                    for mods, caches in zip(rank_modules, rank_caches, strict=True)
                )
                diff = float(mx.abs(cast(mx.array, got) - expected).max())
                assert diff < TOLERANCE, f"{name} {attr} of layer {index} over {size} ranks: {diff}"


def test_communication_per_token_follows_the_ring() -> None:
    model = build_model(
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "vocab_size": 64,
        }
    )

    def count(size: int, rank: int, mode: str) -> int:
        return comm_bytes_per_token(model, cast(Any, _Ranks(size, rank)), cast(Any, mode))

    state = 32 * 4  # one float32 hidden state
    # tensor: 2 all_sums a layer, each rank sending 2 (size - 1) segments of state / size
    assert count(2, 0, "tensor") == 6 * 2 * 1 * state // 2
    assert count(4, 3, "tensor") == 6 * 2 * 3 * state // 4
    # pipeline: the hand-off to the next stage (not from the last) and the broadcast
    assert count(2, 0, "pipeline") == state + state
    broadcast = 2 * 2 * math.ceil(state / 3)
    assert [count(3, r, "pipeline") for r in range(3)] == [state + broadcast] * 2 + [broadcast]


def test_a_group_names_itself_and_refuses_a_process_not_launched() -> None:
    single = Group.single()
    assert (single.rank, single.size, single.is_first, single.is_last) == (0, 1, True, True)
    assert single.describe().startswith("rank 0 of 1 on ")
    with pytest.raises(ValueError, match="unknown distributed backend"):
        Group.init("carrier-pigeon")
    if "MLX_RANK" not in os.environ and mx.distributed.is_available("ring"):
        with pytest.raises(RuntimeError, match=r"mlx\.launch"):
            Group.init("ring")


# -- the tiny models, across processes ------------------------------------------------------


def _builders() -> dict[str, tuple[Callable[[], Any], Callable[[Any, int], None]]]:
    """name -> (transformers model builder, weight spread): every architecture, each
    with at least 4 layers (4 pipeline stages) and heads, experts and widths that split
    over 2 and 4 ranks (4 ranks replicate the 2 key/value and 2 delta-net key heads)."""
    from tests.support import tiny_deepseek, tiny_hybrid, tiny_models, tiny_moe

    moe_spread = partial(tiny_models.randomize, bias_scale=0.1)
    plain = tiny_models.randomize
    hybrid = tiny_hybrid._randomize
    layers = {"num_hidden_layers": 4}
    gemma = {**layers, "final_logit_softcapping": 3.0, "attention_bias": True}
    return {
        "llama": (
            lambda: tiny_models._llama(**layers, attention_bias=True, mlp_bias=True),
            plain,
        ),
        "qwen2_tied": (lambda: tiny_models._qwen2(**layers, tie_word_embeddings=True), plain),
        "qwen3": (lambda: tiny_models._qwen3(**layers), plain),
        "gemma3_text": (lambda: tiny_models._gemma3_text(**gemma), plain),
        "qwen3_moe": (lambda: tiny_moe._qwen3_moe(**layers, mlp_only_layers=[1]), moe_spread),
        "glm4_moe": (
            lambda: tiny_moe._glm4_moe(
                **layers, n_group=4, topk_group=2, n_shared_experts=2, use_qk_norm=True
            ),
            moe_spread,
        ),
        "deepseek_v3": (
            lambda: tiny_deepseek._deepseek(**layers, rope_parameters=dict(tiny_deepseek._YARN)),
            partial(tiny_models.randomize, bias_scale=0.05),
        ),
        "qwen3_next": (tiny_hybrid.VARIANTS["qwen3_next"][0], hybrid),
        "qwen3_5": (tiny_hybrid.VARIANTS["qwen3_5"][0], hybrid),
        "qwen3_5_moe": (tiny_hybrid.VARIANTS["qwen3_5_moe"][0], hybrid),
    }


def _uneven_builders() -> dict[str, tuple[Callable[[], Any], Callable[[Any, int], None]]]:
    """Tensor parallel only (pipeline stages are any size already): head counts and
    widths that 2 and 4 ranks do not divide. SmolLM2's 9 heads over 3 key/value heads
    (padding heads over 2 ranks), Qwen2.5-0.5B's 14 over 2, a delta-net's 6 value heads
    over 3 key heads (repeated key heads over 2 ranks), MLA's 5 heads, MLP widths of
    91, 150, 38 and 30."""
    from tests.support import tiny_deepseek, tiny_hybrid, tiny_models

    plain = tiny_models.randomize
    layers = {"num_hidden_layers": 2}
    # transformers' llama asks hidden_size to be a multiple of the heads
    smollm = {**layers, "hidden_size": 72, "num_attention_heads": 9, "num_key_value_heads": 3}
    hybrid = {
        **layers,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "linear_num_value_heads": 6,
        "linear_num_key_heads": 3,
        "intermediate_size": 91,
        "shared_expert_intermediate_size": 38,
        "mlp_only_layers": [1],
        "full_attention_interval": 2,
    }
    mla = {
        **layers,
        "num_attention_heads": 5,
        "num_key_value_heads": 5,
        "intermediate_size": 91,
        "moe_intermediate_size": 30,
        "rope_parameters": dict(tiny_deepseek._YARN),
    }
    return {
        "uneven_llama": (
            lambda: tiny_models._llama(
                **smollm, intermediate_size=91, attention_bias=True, mlp_bias=True
            ),
            plain,
        ),
        "uneven_qwen2": (
            lambda: tiny_models._qwen2(
                **layers,
                hidden_size=112,
                num_attention_heads=14,
                num_key_value_heads=2,
                intermediate_size=150,
            ),
            plain,
        ),
        "uneven_qwen3_next": (lambda: tiny_hybrid._qwen3_next(**hybrid), tiny_hybrid._randomize),
        "uneven_deepseek_v3": (
            lambda: tiny_deepseek._deepseek(**mla),
            partial(tiny_models.randomize, bias_scale=0.05),
        ),
    }


# SmolLM2's heads with head_dim = the group size (32): padding heads are zero groups of
# o_proj; the MLP's 5 groups split 3 + 2 and 2 + 1 + 1 + 1
_UNEVEN_QUANTIZED = {
    "num_hidden_layers": 2,
    "hidden_size": 288,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 32,
    "intermediate_size": 160,
}


def _quantize_folder(src: Path, dst: Path) -> None:
    """An MLX-quantized copy of a checkpoint, as mlx-community publishes them: sanitized
    names, every linear layer and expert stack 4-bit in groups of 32 (routers 8-bit)."""
    from tests.support import tiny_models

    model = tiny_models.load_mlx(src)
    raw = mx.load(str(src / "model.safetensors"))
    assert isinstance(raw, dict)
    out: dict[str, mx.array] = {}
    overrides: dict[str, Any] = {}
    for name, value in model.sanitize(dict(raw)).items():
        if name.endswith(".weight") and value.ndim in (2, 3) and "embed" not in name:
            tiny_models.quantize_weight(out, overrides, name, value)
        else:
            out[name] = value
    tiny_models.save_quantized(src, dst, out, overrides)
    tiny_models.write_tokenizer(dst, tiny_models.VOCAB)


def save_every_architecture(root: Path, reference: Callable[[Any, Path], None]) -> Path:
    """`root` with every tiny model of `_builders` saved in a folder of its own, and
    `reference(loaded model, folder)` run on each; skips where the ring backend cannot run."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("this MLX build has no ring backend (mx.distributed.is_available)")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from runtime.load.loader import load
    from tests.support import tiny_models

    for name, (builder, spread) in _builders().items():
        folder = root / name
        tiny_models.save_tiny((builder, None), folder, seed=3, spread=spread)
        tiny_models.write_tokenizer(folder, tiny_models.VOCAB)
        reference(load(folder, dtype="float32"), folder)
    return root


# Quantized layers multiply decode rows in float32 in the reference and in the ranks: the
# default int16 rounding of those rows (runtime/kernels/qdot.c) moved a sharded 4-bit MoE's
# logits by ~7e-4 from the single process's, to be explained; sharding is checked exactly
_FLOAT_ROWS = ("MLX_GATEWAY_CPU_ACTIVATIONS", "float32")

# widths for 4-bit groups of 32 that still hold whole groups per rank over 4 ranks
# (o_proj's 128 inputs, down_proj's 256)
_QUANTIZED = {
    "hidden_size": 128,
    "head_dim": 32,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "mlp_only_layers": [1],
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tiny model saved as a checkpoint, with the single-process run's results."""
    from runtime.load.loader import load
    from tests.support import tiny_models, tiny_moe
    from tests.support.distributed_worker import write_reference

    with pytest.MonkeyPatch.context() as patch:  # float rows, as the ranks (_FLOAT_ROWS)
        patch.setenv(*_FLOAT_ROWS)
        return _save_cases(tmp_path_factory, load, tiny_models, tiny_moe, write_reference)


def _save_cases(
    tmp_path_factory: pytest.TempPathFactory,
    load: Any,
    tiny_models: Any,
    tiny_moe: Any,
    write_reference: Any,
) -> Path:
    root = save_every_architecture(tmp_path_factory.mktemp("distributed"), write_reference)
    source = tmp_path_factory.mktemp("unquantized")
    tiny_models.save_tiny(
        (lambda: tiny_moe._qwen3_moe(**_QUANTIZED), None),
        source,
        seed=3,
        spread=partial(tiny_models.randomize, bias_scale=0.1),
    )
    quantized = root / "qwen3_moe_4bit"
    _quantize_folder(source, quantized)
    loaded = load(quantized, dtype="float32", keep_quantized=True)
    assert loaded.quantized
    write_reference(loaded, quantized)
    for name, (builder, spread) in _uneven_builders().items():
        folder = root / name
        tiny_models.save_tiny((builder, None), folder, seed=3, spread=spread)
        tiny_models.write_tokenizer(folder, tiny_models.VOCAB)
        write_reference(load(folder, dtype="float32"), folder, modes=("tensor",))
    source = tmp_path_factory.mktemp("uneven_unquantized")
    tiny_models.save_tiny((lambda: tiny_models._llama(**_UNEVEN_QUANTIZED), None), source, seed=3)
    quantized = root / "uneven_llama_4bit"
    _quantize_folder(source, quantized)
    write_reference(load(quantized, dtype="float32", keep_quantized=True), quantized, ("tensor",))
    return root


def launch_workers(
    size: int, worker: Path, cases: Path, out: Path, timeout: float = LAUNCH_TIMEOUT
) -> str:
    """`size` ranks of `worker CASES OUT` (ring backend, loopback, started as mlx.launch
    starts them: tests/support/ring_launch.py), one BLAS thread each (they share the two
    cores); their output, once all succeeded."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        _FLOAT_ROWS[0]: _FLOAT_ROWS[1],
    }
    argv = [str(worker), str(cases), str(out)]
    codes, output = run_ring(size, argv, cwd=ROOT, env=env, logs=out, timeout=timeout)
    if None in codes and all(c in (None, 0) for c in codes):
        pytest.fail(f"{size} ranks did not finish in {timeout} s:\n{output[-4000:]}")
    assert codes == [0] * size, f"{size} ranks failed ({codes}):\n{output[-4000:]}"
    return output


def _reports(size: int, cases: Path, out: Path) -> list[dict[str, Any]]:
    output = launch_workers(size, WORKER, cases, out)
    missing = [r for r in range(size) if not (out / f"rank{r}.json").exists()]
    assert not missing, f"ranks {missing} of {size} wrote no report:\n{output[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(size)]


def _check(result: dict[str, Any], whole: dict[str, Any], label: str) -> None:
    """One rank's run of one case against the single-process one."""
    assert result["shapes_match"], label
    assert result["max_diff"] < TOLERANCE, f"{label}: {result['max_diff']}"
    assert result["comm_bytes_per_token"] > 0, label
    assert result["quantized"] == whole["quantized"], label
    # the rank holds, and while loading ever held, less than the whole model
    assert result["parameter_bytes"] < whole["parameter_bytes"], label
    assert result["load_peak_bytes"] < whole["parameter_bytes"], label
    if result["mode"] == "pipeline":
        start, stop = result["layers"]
        assert result["caches"] == result["fresh_caches"] == stop - start, label
        assert result["caches"] < whole["caches"], label
    else:
        assert result["caches"] == whole["caches"], label
    # every layer's cache shrinks but MLA's latent, which all of a layer's heads share
    if "deepseek_v3" in result["case"] and result["mode"] == "tensor":
        assert result["cache_bytes"] == whole["cache_bytes"], label
    else:
        assert result["cache_bytes"] < whole["cache_bytes"], label


@pytest.mark.parametrize("size", [2, 4])
def test_every_architecture_matches_one_process(size: int, cases: Path, tmp_path: Path) -> None:
    reports = _reports(size, cases, tmp_path)
    assert [r["rank"] for r in reports] == list(range(size))
    assert all(r["size"] == size for r in reports)
    names = sorted(p.name for p in cases.iterdir() if p.is_dir())
    for report in reports:
        assert sorted({r["case"] for r in report["results"]}) == names
        for result in report["results"]:
            whole = json.loads((cases / result["case"] / "reference.json").read_text())
            label = f"{result['case']} {result['mode']} rank {report['rank']}/{size}"
            _check(result, whole, label)
    # a pipeline's stages cover every layer once, in order
    for case in names:
        if "pipeline" not in json.loads((cases / case / "reference.json").read_text())["modes"]:
            continue
        bounds = [
            next(
                r["layers"]
                for r in report["results"]
                if (r["case"], r["mode"]) == (case, "pipeline")
            )
            for report in reports
        ]
        whole = json.loads((cases / case / "reference.json").read_text())
        assert bounds[0][0] == 0 and bounds[-1][1] == whole["caches"], case
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds)), case
