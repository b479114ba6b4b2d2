"""`mlx-gateway run`: an interactive streaming chat in the terminal, no HTTP."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.cli.common import engine_settings, resolve
from gateway.cli.errors import CliError
from gateway.core.models import ServedModel, build_served, check_draft_tokenizer
from gateway.core.settings import EngineSettings
from runtime.types import Finished, GenerationRequest, SamplingParams, TextDelta
from templates import Message, RenderOptions, render_prompt


def run(args: argparse.Namespace) -> int:
    """`mlx-gateway run MODEL [PROMPT]`."""
    settings = engine_settings(args)
    path, model_id = resolve(args.model)
    if settings.draft_model is not None:
        try:
            check_draft_tokenizer(path, settings.draft_model)
        except (ValueError, OSError) as exc:
            raise CliError(f"draft model {settings.draft_model}: {exc}") from None
    return run_chat(path, model_id, args, settings)


def _answer(served: ServedModel, history: list[Message], args: argparse.Namespace) -> str:
    if not served.caps.chat:
        raise SystemExit(f"error: {served.id} has no chat template; use the HTTP completions API")
    rendered = render_prompt(served.renderer, tuple(history), (), RenderOptions(), served.controls)
    tokens = served.loaded.tokenizer.encode_prompt(rendered.text, content=rendered.content)
    max_tokens = served.check_fits(len(tokens), None)
    request = GenerationRequest(
        tuple(tokens),
        min(args.max_tokens, max_tokens),
        SamplingParams(temperature=args.temperature),
    )
    out: list[str] = []
    for event in served.engine.submit(request):
        if isinstance(event, TextDelta):
            out.append(event.text)
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Finished) and event.error:
            print(f"\nerror: {event.error}", file=sys.stderr)
    sys.stdout.write("\n")
    return "".join(out)


def run_chat(path: Path, model_id: str, args: argparse.Namespace, settings: EngineSettings) -> int:
    served = build_served(path, model_id=model_id, settings=settings)
    served.engine.start()
    history: list[Message] = []
    if args.system:
        history.append(Message(role="system", content=args.system))
    try:
        if args.prompt is not None:
            history.append(Message(role="user", content=args.prompt))
            _answer(served, history, args)
            return 0
        print(f"chatting with {model_id}; empty line or Ctrl-D to quit", file=sys.stderr)
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                break
            if not line.strip():
                break
            history.append(Message(role="user", content=line))
            reply = _answer(served, history, args)
            history.append(Message(role="assistant", content=reply))
    except KeyboardInterrupt:
        pass
    finally:
        served.engine.stop()
    return 0
