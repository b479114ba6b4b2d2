"""Messages + tools -> prompt text: HF chat templates in a sandbox, plus built-in renderers."""

from templates.content import (
    FORMAT_MARKUP,
    ControlStrings,
    control_strings,
    render_prompt,
    splice,
)
from templates.deepseek import DeepSeekV3Renderer, DeepSeekV31Renderer
from templates.gemma3 import Gemma3Renderer
from templates.glm47 import Glm47Renderer
from templates.hf import HFTemplateRenderer
from templates.llama3 import Llama3Renderer, Llama30Renderer
from templates.qwen3 import Qwen3Renderer, Qwen25Renderer
from templates.qwen3_coder import Qwen3CoderRenderer
from templates.qwen35 import Qwen35Renderer
from templates.registry import (
    MissingTemplateRenderer,
    builtin_families,
    builtin_family_for,
    builtin_model_types,
    builtin_renderer,
    renderer_for,
)
from templates.render_limits import RenderLimits
from templates.turns import TURN_OPENERS
from templates.types import (
    ContentPart,
    ImagePart,
    Message,
    Rendered,
    Renderer,
    RenderOptions,
    TemplateError,
    TextPart,
    Tool,
    ToolCall,
)

__all__ = [
    "FORMAT_MARKUP",
    "TURN_OPENERS",
    "ContentPart",
    "ControlStrings",
    "DeepSeekV3Renderer",
    "DeepSeekV31Renderer",
    "Gemma3Renderer",
    "Glm47Renderer",
    "HFTemplateRenderer",
    "ImagePart",
    "Llama3Renderer",
    "Llama30Renderer",
    "Message",
    "MissingTemplateRenderer",
    "Qwen3CoderRenderer",
    "Qwen3Renderer",
    "Qwen25Renderer",
    "Qwen35Renderer",
    "RenderLimits",
    "RenderOptions",
    "Rendered",
    "Renderer",
    "TemplateError",
    "TextPart",
    "Tool",
    "ToolCall",
    "builtin_families",
    "builtin_family_for",
    "builtin_model_types",
    "builtin_renderer",
    "control_strings",
    "render_prompt",
    "renderer_for",
    "splice",
]
