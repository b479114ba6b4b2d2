"""`mlx-gateway show MODEL`: what a downloaded model is, without loading its weights:
architecture, parameters, context length, weight format, chat template family,
capabilities and where its files are. A folder's config.json and safetensors headers, or
a GGUF file's metadata and tensor table (runtime.load's reader), are all it reads; a
model not downloaded yet is not fetched (`mlx-gateway pull` does that).

    mlx-gateway show MODEL [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from gguf.constants import LlamaFileType
from safetensors import safe_open

from gateway.cli.errors import FAILED, CliError
from gateway.cli.store.names import RepoRef
from gateway.cli.store.store import Store
from gateway.core.capabilities import Capabilities, detect
from runtime.load import GGUFFile, context_length, hf_config
from runtime.text import read_chat_template
from templates import builtin_family_for

# tensors that only scale or shift a quantized weight: not parameters of the model
_SCALE_SUFFIXES = (".scales", ".biases", "weight_scale_inv", "weight_scale", "input_scale")


def local_hub(ref: RepoRef, _stream: TextIO) -> Path:
    """The model's path in the Hub cache, as `pull` left it; never downloads."""
    # imported on use: the Hub client is slow to import and only a repo id needs it
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True))
    except LocalEntryNotFoundError:
        raise CliError(f"'{ref}' is not downloaded; run `mlx-gateway pull {ref}`", FAILED) from None
    if ref.filename is None and (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p for p in folder.rglob("*.gguf"))
    tag = (ref.filename or "").lower()
    picked = [p for p in ggufs if tag == p.relative_to(folder).as_posix().lower()]
    picked = picked or [p for p in ggufs if tag in p.name.lower()]
    if len(picked) != 1:
        found = ", ".join(p.name for p in ggufs) or "none"
        raise CliError(
            f"'{ref}' names no single downloaded model file (GGUF files: {found})", FAILED
        )
    return picked[0]


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _safetensors_facts(folder: Path, config: Mapping[str, Any]) -> tuple[int, str]:
    """Parameters (a packed quantized weight counted as the values it holds) and the
    weight format, from the files' headers."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, Mapping) else None
    params = 0
    dtypes: Counter[str] = Counter()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                part = f.get_slice(name)
                count = math.prod(part.get_shape())
                if name.endswith(_SCALE_SUFFIXES):
                    continue
                dtype = str(part.get_dtype())
                if dtype == "U32" and isinstance(bits, int):
                    count = count * 32 // bits  # 32 / bits values packed in each word
                params += count
                dtypes[dtype] += count
    if isinstance(quant, Mapping) and isinstance(bits, int):
        fmt = f"{bits}-bit MLX affine, group {quant.get('group_size', 64)}"
    elif isinstance(quant, Mapping) and quant.get("quant_method"):
        fmt = f"{str(quant['quant_method']).upper()} ({_mix(dtypes)})"
    else:
        fmt = _mix(dtypes)
    return params, fmt


def _mix(counts: Counter[str]) -> str:
    """'BF16', or 'Q4_K (most weights; also Q6_K, F32)'."""
    if not counts:
        return "unknown"
    top, *rest = [name for name, _ in counts.most_common()]
    return top if not rest else f"{top} (most weights; also {', '.join(rest)})"


def _folder_facts(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot read {folder / 'config.json'}: {exc}", FAILED) from None
    params, fmt = _safetensors_facts(folder, config)
    text = _text_config(config)
    archs = config.get("architectures") or []
    return {
        "model_type": str(config.get("model_type", "")),
        "architecture_class": archs[0] if archs else None,
        "parameters": params,
        "context_length": context_length(config),
        "embedding_length": text.get("hidden_size"),
        "layers": text.get("num_hidden_layers"),
        "quantization": fmt,
        "chat_template": read_chat_template(folder),
        "vision": isinstance(config.get("vision_config"), Mapping),
    }


def _gguf_format(file_type: object, types: Counter[str]) -> str:
    """The file's declared type as llama.cpp names it (Q4_K_M), with its tensors' types."""
    try:
        name = LlamaFileType(int(file_type)).name  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return _mix(types)
    name = name.removeprefix("MOSTLY_").removeprefix("ALL_")
    return f"{name} (tensors: {', '.join(t for t, _ in types.most_common())})"


def _gguf_facts(path: Path) -> dict[str, Any]:
    gf = GGUFFile(path)
    try:
        config: Mapping[str, Any] = hf_config(gf)
    except (ValueError, KeyError):  # an architecture the loader does not serve
        config = {"model_type": gf.architecture}
    types: Counter[str] = Counter()
    for t in gf.tensors.values():
        types[t.type_name] += t.nbytes
    template = gf.get("tokenizer.chat_template")
    return {
        "model_type": str(config.get("model_type", gf.architecture)),
        "architecture_class": gf.architecture,
        "parameters": sum(math.prod(t.shape) for t in gf.tensors.values()),
        "context_length": context_length(config),
        "embedding_length": config.get("hidden_size"),
        "layers": config.get("num_hidden_layers"),
        "quantization": _gguf_format(gf.get("general.file_type"), types),
        "chat_template": template if isinstance(template, str) else None,
        "vision": False,  # a GGUF's image encoder is a separate mmproj file
    }


def _files(path: Path) -> dict[str, Any]:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    return {
        "path": str(path),
        "files": [p.name for p in files],
        "size_bytes": sum(p.stat().st_size for p in files),  # a Hub cache link: its blob
    }


def describe(path: Path) -> dict[str, Any]:
    """What `show` prints, as JSON."""
    facts = _gguf_facts(path) if path.is_file() else _folder_facts(path)
    template = facts.pop("chat_template")
    has_template = bool(template and template.strip())
    family = None if has_template else builtin_family_for(facts["model_type"])
    caps: Capabilities = detect(
        model_type=facts["model_type"],
        chat_template=template if has_template else None,
        builtin_family=family,
        vision=facts.pop("vision"),
    )
    names = ["completion", *(n for n in ("chat", "tools", "thinking", "vision") if caps.card()[n])]
    return {
        **facts,
        "template": {
            "source": "model" if has_template else ("built-in" if family else None),
            "family": family,
            "parser": caps.parser,
        },
        "capabilities": names,
        **_files(path),
    }


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def render(name: str, d: Mapping[str, Any]) -> str:
    cls = d["architecture_class"]
    arch = d["model_type"] + (f" ({cls})" if cls and cls != d["model_type"] else "")
    t = d["template"]
    template = {"model": "the model's own", "built-in": f"built-in {t['family']}"}.get(
        str(t["source"]), "none (raw completions only)"
    )
    rows = [
        ("Model", ""),
        ("architecture", arch),
        ("parameters", f"{_count(d['parameters'])} ({d['parameters']:,})"),
        ("context length", str(d["context_length"])),
        ("embedding length", str(d["embedding_length"] or "-")),
        ("layers", str(d["layers"] or "-")),
        ("quantization", d["quantization"]),
        ("Template", ""),
        ("chat template", template),
        ("tool-call parser", t["parser"]),
        ("Capabilities", ""),
        *((c, " ") for c in d["capabilities"]),
        ("Files", ""),
        ("path", d["path"]),
        ("size", f"{d['size_bytes'] / 1e6:.1f} MB in {len(d['files'])} file(s)"),
    ]
    lines = [f"  {name}"]
    for key, value in rows:
        lines.append(f"\n  {key}" if not value else f"    {key:<18}{value}".rstrip())
    return "\n".join(lines)


def show(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    path = Store(hub=local_hub).resolve(args.model, fetch=False)
    described = describe(path)
    if args.json:
        out.write(json.dumps({"model": args.model, **described}, indent=2) + "\n")
    else:
        out.write(render(args.model, described) + "\n")
    return 0
