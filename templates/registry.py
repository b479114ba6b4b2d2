"""Choosing a renderer for a model: its own template, else a built-in for its family.

A built-in is named by family ("qwen3", "llama3", ...). The gateway's per-model config
may force one (`prefer_builtin`), for models whose own template is missing or wrong; a
model without a template gets the built-in its model_type maps to, where that mapping
is unambiguous enough to be a safe default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from templates.deepseek import DeepSeekV3Renderer, DeepSeekV31Renderer
from templates.gemma3 import Gemma3Renderer
from templates.glm47 import Glm47Renderer
from templates.hf import HFTemplateRenderer
from templates.llama3 import Llama3Renderer, Llama30Renderer
from templates.qwen3 import Qwen3Renderer, Qwen25Renderer
from templates.qwen3_coder import Qwen3CoderRenderer
from templates.qwen35 import Qwen35Renderer
from templates.types import Message, Renderer, RenderOptions, TemplateError, Tool

# (bos_token, eos_token) -> renderer
BuiltinFactory = Callable[[str | None, str | None], Renderer]

# Family name -> built-in renderer. Each module's docstring names its source.
_FAMILIES: Mapping[str, BuiltinFactory] = MappingProxyType(
    {
        "deepseek-v3": lambda bos, eos: DeepSeekV3Renderer(bos_token=bos),
        "deepseek-v3.1": lambda bos, eos: DeepSeekV31Renderer(bos_token=bos),
        "gemma3": lambda bos, eos: Gemma3Renderer(bos_token=bos),
        "glm-4.7": lambda bos, eos: Glm47Renderer(),
        "llama3": lambda bos, eos: Llama3Renderer(bos_token=bos),
        "llama3.0": lambda bos, eos: Llama30Renderer(bos_token=bos),
        "qwen2.5": lambda bos, eos: Qwen25Renderer(),
        "qwen3": lambda bos, eos: Qwen3Renderer(),
        "qwen3-coder": lambda bos, eos: Qwen3CoderRenderer(),
        "qwen3.5": lambda bos, eos: Qwen35Renderer(),
    }
)

# model_type (config.json, or the GGUF architecture) -> family, for models without a
# template. Left out on purpose: "llama" (SmolLM2 and others share it), "qwen2" (Qwen2
# and Qwen2.5 differ), "deepseek_v3" (V3, V3.1 and R1 differ), "glm4_moe" (GLM-4.5/4.6
# format). qwen3_moe also covers Qwen3-Coder; configure "qwen3-coder" for those.
_MODEL_TYPES: Mapping[str, str] = MappingProxyType(
    {
        "gemma3": "gemma3",
        "gemma3_text": "gemma3",
        "glm4_moe_lite": "glm-4.7",
        "qwen3": "qwen3",
        "qwen3_moe": "qwen3",
        "qwen3moe": "qwen3",
        "qwen3_5": "qwen3.5",
        "qwen3_5_text": "qwen3.5",
        "qwen3_5_moe": "qwen3.5",
        "qwen3_5_moe_text": "qwen3.5",
        "qwen35": "qwen3.5",
        "qwen35moe": "qwen3.5",
    }
)


def builtin_families() -> frozenset[str]:
    """Family names `builtin_renderer` and `renderer_for(prefer_builtin=...)` accept."""
    return frozenset(_FAMILIES)


def builtin_model_types() -> frozenset[str]:
    """model_types that get a built-in renderer when the model has no template."""
    return frozenset(_MODEL_TYPES)


def builtin_family_for(model_type: str | None) -> str | None:
    """The built-in family a model without a template gets by its model_type, if any."""
    return _MODEL_TYPES.get(model_type or "")


def builtin_renderer(family: str, *, bos_token: str | None, eos_token: str | None) -> Renderer:
    """The built-in renderer for `family`; TemplateError names the known ones otherwise."""
    factory = _FAMILIES.get(family)
    if factory is None:
        known = ", ".join(sorted(_FAMILIES))
        raise TemplateError(f"no built-in chat renderer for family {family!r}; known: {known}")
    return factory(bos_token, eos_token)


class MissingTemplateRenderer:
    """Stands in for a model with no chat template, so the model still loads and serves
    /v1/completions; only chat rendering fails, with a message that says so."""

    def __init__(self, model_type: str | None) -> None:
        self.model_type = model_type

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool], options: RenderOptions
    ) -> str:
        kind = f" (model type {self.model_type!r})" if self.model_type else ""
        raise TemplateError(
            f"this model{kind} has no chat template and no built-in one applies, so chat "
            "messages cannot be rendered; use /v1/completions with a raw prompt instead, "
            "or configure a chat template for the model"
        )


def renderer_for(
    chat_template: str | None,
    *,
    bos_token: str | None,
    eos_token: str | None,
    model_type: str | None,
    prefer_builtin: str | None = None,
) -> Renderer:
    """The built-in for `prefer_builtin` when given (an unknown family raises
    TemplateError); else the model's own template when it has one (compiled here, once;
    a template that does not compile raises TemplateError), else the built-in for
    `model_type`, else a renderer whose every call raises TemplateError."""
    if prefer_builtin is not None:
        return builtin_renderer(prefer_builtin, bos_token=bos_token, eos_token=eos_token)
    if chat_template is not None and chat_template.strip():
        return HFTemplateRenderer(chat_template, bos_token=bos_token, eos_token=eos_token)
    family = _MODEL_TYPES.get(model_type or "")
    if family is not None:
        return builtin_renderer(family, bos_token=bos_token, eos_token=eos_token)
    return MissingTemplateRenderer(model_type)
