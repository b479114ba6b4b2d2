"""Messages + tools -> prompt text: HF chat templates in a sandbox, plus built-in renderers."""

from templates.gemma3 import Gemma3Renderer
from templates.hf import HFTemplateRenderer
from templates.registry import MissingTemplateRenderer, builtin_model_types, renderer_for
from templates.types import (
    ContentPart,
    ImagePart,
    Message,
    Renderer,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
    ToolCall,
)

__all__ = [
    "ContentPart",
    "Gemma3Renderer",
    "HFTemplateRenderer",
    "ImagePart",
    "Message",
    "MissingTemplateRenderer",
    "RenderOptions",
    "Renderer",
    "TemplateError",
    "TextPart",
    "Tool",
    "ToolCall",
    "builtin_model_types",
    "renderer_for",
]
