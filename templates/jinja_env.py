"""The sandboxed jinja2 environment HF chat templates expect.

Templates are written against transformers' renderer, so this offers the same
variables, globals and filters: `raise_exception`, `strftime_now`, a `tojson` that
does not HTML-escape, a restricted `dict` and `namespace`, loop controls, and the
`{% generation %}` block (rendered as its body). Templates are untrusted code,
hence the immutable sandbox, and bounds on each render's time and on the size of what
it builds (templates/render_limits.py), which this environment checks at every loop
step, call, operator, filter and concatenation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from templates.render_limits import (
    RenderLimitExceeded,
    RenderLimits,
    check_binop,
    check_format,
    check_str_method,
    check_value,
    guard_filter,
    tick,
)

# the most a template's tojson may indent by (real templates use 2 or 4)
_MAX_JSON_INDENT = 64


class RaisedByTemplate(jinja2.TemplateError):
    """A template's own `raise_exception(message)`: its message goes to the client as is."""


def _raise_exception(message: str) -> None:
    raise RaisedByTemplate(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would corrupt prompts.
    width = len(indent) if isinstance(indent, str) else indent or 0
    if width > _MAX_JSON_INDENT:
        raise RenderLimitExceeded(f"tojson indent {width} is over {_MAX_JSON_INDENT}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace(...)` that refuses underscore names, which could reach CPython internals."""

    # Same signature trick as Namespace, so a template may pass `self=` as a name.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed names on a namespace: {name!r}"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    when rendering prompts it is just its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Ticking:
    """A loop's iterable that checks the render's deadline at every step (its length,
    when it has one, stays visible to `loop.length` and `loop.last`)."""

    def __init__(self, items: Iterable[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)  # type: ignore[arg-type]  # TypeError: jinja counts itself

    def __iter__(self) -> Iterator[Any]:
        for item in self._items:
            tick()
            yield item


class _Guards(NodeTransformer):
    """Rewrites a parsed template so that every `for` iterates through `bounded_iter`,
    and every `~` concatenation and list, tuple or dict display passes `bounded_value`
    (none of them has a sandbox hook; `[x, x]` doubles a size as `x * 2` does)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = _env_call("bounded_iter", node.iter)
        return node

    def _bounded(self, node: nodes.Expr) -> nodes.Node:
        self.generic_visit(node)
        return _env_call("bounded_value", node)

    visit_Concat = visit_List = visit_Dict = _bounded

    def visit_Tuple(self, node: nodes.Tuple) -> nodes.Node:
        # a tuple is also an assignment target (`for k, v in ...`): only values are checked
        return self._bounded(node) if node.ctx == "load" else self.generic_visit(node)


def _env_call(method: str, arg: nodes.Node) -> nodes.Call:
    """`environment.<method>(arg)`, a call the sandbox allows (it is ours)."""
    call = nodes.Call(nodes.EnvironmentAttribute(method), [arg], [], None, None)
    call.set_lineno(arg.lineno)
    return call


class ChatTemplateEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every render bounded by `limits` (time and size)."""

    # operators that can multiply a size; the sandbox routes them through call_binop
    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, limits: RenderLimits, **options: Any) -> None:
        super().__init__(**options)
        self.limits = limits
        # the output of a render, a macro, a `{% set %}` block or a `{% filter %}` block
        self.concat = self._bounded_concat  # type: ignore[method-assign]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        guarded = _Guards().visit(tree)
        assert isinstance(guarded, nodes.Template)
        return guarded

    def _bounded_concat(self, pieces: Iterable[str]) -> str:
        out: list[str] = []
        total = 0
        for piece in pieces:  # (many pieces take many loop steps, and those tick)
            total += len(piece)
            if total > self.limits.max_chars:
                raise RenderLimitExceeded(
                    f"the chat template writes over {self.limits.max_chars} characters"
                )
            out.append(piece)
        return "".join(out)

    def bounded_iter(self, items: Iterable[Any]) -> _Ticking:
        return _Ticking(items)

    def bounded_value(self, value: Any) -> Any:
        return check_value(value, self.limits)

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right, self.limits)
        return check_value(super().call_binop(context, operator, left, right), self.limits)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        tick()
        owner = getattr(__obj, "__self__", None)
        if not isinstance(owner, str):
            result = super().call(__context, __obj, *args, **kwargs)
            return check_value(result, __self.limits)  # e.g. dict(a=x, b=x) doubles x
        # a string method: those that can multiply a size are checked before they run
        name = getattr(__obj, "__name__", "")
        if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
            args = (list(args[0]), *args[1:])  # an iterator: count it, join the list
        check_str_method(owner, name, args, __self.limits)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__
        is_map = value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> Any:
            tick()
            mapping = args[0] if is_map and args and isinstance(args[0], dict) else kwargs
            check_format(fmt, () if is_map else args, mapping)
            return check_value(wrapped(*args, **kwargs), self.limits)

        return checked


def make_environment(limits: RenderLimits | None = None) -> ChatTemplateEnvironment:
    """A fresh environment; each renderer owns one, so nothing is shared between models."""
    env = ChatTemplateEnvironment(
        limits or RenderLimits(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: guard_filter(name, f, env.limits) for name, f in env.filters.items()}
    # lipsum(n, min, max) runs for as long as its numbers say, in one uninterruptible
    # call; no chat template uses it
    del env.globals["lipsum"]
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
