"""Choosing a renderer for a model: its own template, else a built-in for its family."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from templates.gemma3 import Gemma3Renderer
from templates.hf import HFTemplateRenderer
from templates.types import Message, Renderer, RenderOptions, TemplateError, Tool

BuiltinFactory = Callable[[str | None, str | None], Renderer]


def _gemma3(bos_token: str | None, eos_token: str | None) -> Renderer:
    return Gemma3Renderer(bos_token=bos_token)


# model_type (config.json, or the GGUF architecture) -> built-in renderer.
_BUILTINS: Mapping[str, BuiltinFactory] = MappingProxyType(
    {
        "gemma3": _gemma3,
        "gemma3_text": _gemma3,
    }
)


def builtin_model_types() -> frozenset[str]:
    return frozenset(_BUILTINS)


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
) -> Renderer:
    """The model's own template when it has one (compiled here, once; a template that
    does not compile raises TemplateError), else the built-in for `model_type`, else a
    renderer whose every call raises TemplateError."""
    if chat_template is not None and chat_template.strip():
        return HFTemplateRenderer(chat_template, bos_token=bos_token, eos_token=eos_token)
    factory = _BUILTINS.get(model_type or "")
    if factory is not None:
        return factory(bos_token, eos_token)
    return MissingTemplateRenderer(model_type)
