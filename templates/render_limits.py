"""Bounds on one chat-template render: its time, and the size of what it builds.

Chat templates come with downloaded models, so they are untrusted code. The sandbox keeps
them away from Python internals; these bounds keep one from hanging a worker thread or
filling memory (`range(10**5)` nested in itself, `'x' * 10**10`, a doubling loop):

- a deadline, checked at every loop step, call and filter (`tick`): a template without
  loops and calls runs in time proportional to its source;
- a cap on the characters of any string, and the items of any collection (nested ones
  counted too), a template builds: operations that multiply a size (`*`, `**`, `%` and
  format widths, `replace`, `join`, `indent`, `wordwrap`, ...) are checked before they
  run, everything else after (`check_value`);
- numbers that set a size (widths, counts, tab stops) at most MAX_NUMBER, jinja's own
  bound on `range`.

A render over a bound fails with RenderLimitExceeded, a jinja2 SecurityError, so the
caller sees it as one more template error.
"""

from __future__ import annotations

import functools
import inspect
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE

MAX_NUMBER = MAX_RANGE  # widths, counts and tab stops a filter or string method may take
MAX_INT_BITS = 1 << 16  # integers a template computes (`**`, `*`): about 20,000 digits
_TICK_EVERY = 4096  # items a size walk counts between deadline checks
_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
# printf-style conversions: optional mapping key, flags, width, precision
_PRINTF = re.compile(r"%%|%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class RenderLimits:
    """One render's allowance. The defaults leave a real conversation far inside them:
    rendering a long one takes milliseconds, and its text is at most the request body
    (32 MiB by default) plus the template's own."""

    seconds: float = 10.0
    max_chars: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.seconds <= 0 or self.max_chars < 1:
            raise ValueError("render limits must be positive")


class RenderLimitExceeded(SecurityError):
    """A render ran past its deadline or built a value over the size cap."""


class _Budget:
    def __init__(self, limits: RenderLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        # id -> (container, size): a template cannot change a container (the sandbox is
        # immutable), so each is measured once; holding it keeps its id from reuse
        self.sizes: dict[int, tuple[object, int]] = {}


_active = threading.local()  # the render running on this thread (renders are synchronous)


@contextmanager
def render_budget(limits: RenderLimits) -> Iterator[None]:
    """Run a render (or several attempts at one) under `limits`' deadline; a nested
    budget keeps the outer deadline."""
    if getattr(_active, "budget", None) is not None:
        yield
        return
    _active.budget = _Budget(limits)
    try:
        yield
    finally:
        _active.budget = None


def tick() -> None:
    """Fail the render on this thread if it is past its deadline."""
    budget: _Budget | None = getattr(_active, "budget", None)
    if budget is not None and time.monotonic() > budget.deadline:
        raise RenderLimitExceeded(
            f"the chat template ran for more than {budget.limits.seconds:g} s "
            "(does it loop without end?)"
        )


def size(value: object, most: int) -> int:
    """Characters of a string; for a collection, its items plus the sizes of the strings
    and collections it holds, counted wherever they occur (as printing it would), so
    `[x, x]` is twice `x`. Stops counting once over `most`."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if not isinstance(value, _SIZED):
        return 0
    budget: _Budget | None = getattr(_active, "budget", None)
    return _tree(value, most, budget.sizes if budget is not None else {})


def _tree(value: Any, most: int, memo: dict[int, tuple[object, int]]) -> int:
    known = memo.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    total = len(value)
    items = (x for pair in value.items() for x in pair) if isinstance(value, dict) else value
    for n, item in enumerate(items, 1):
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, _SIZED):
            total += _tree(item, most - total, memo)
        if total > most:
            return total  # not remembered: the count stopped early
        if n % _TICK_EVERY == 0:
            tick()
    memo[id(value)] = (value, total)
    return total


def _refuse_size(estimate: int, limits: RenderLimits, what: str) -> None:
    if estimate > limits.max_chars:
        raise RenderLimitExceeded(
            f"the chat template builds {what} over {limits.max_chars} characters or items"
        )


def check_value(value: Any, limits: RenderLimits, what: str = "a value") -> Any:
    """`value` itself, once it is known to be within the size cap."""
    if isinstance(value, _SIZED):
        _refuse_size(size(value, limits.max_chars), limits, what)
    return value


def check_number(value: object, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_NUMBER:
        raise RenderLimitExceeded(
            f"{what} is {value}; a chat template may use at most {MAX_NUMBER}"
        )


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise RenderLimitExceeded(f"the chat template computes an integer over {MAX_INT_BITS} bits")


# -- operators -------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_binop(operator: str, left: Any, right: Any, limits: RenderLimits) -> None:
    """Refuse `left <operator> right` when its result would be over the bounds."""
    if operator == "*":
        if _is_int(left) and _is_int(right):
            _check_bits(left.bit_length() + right.bit_length())
        elif _is_int(right) and isinstance(left, _SIZED):
            _refuse_size(size(left, limits.max_chars) * max(right, 0), limits, "a repetition")
        elif _is_int(left) and isinstance(right, _SIZED):
            _refuse_size(size(right, limits.max_chars) * max(left, 0), limits, "a repetition")
    elif operator == "**" and _is_int(left) and _is_int(right) and right > 0:
        _check_bits(left.bit_length() * right)
    elif operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
        most = limits.max_chars
        _refuse_size(size(left, most) + size(right, most), limits, "a concatenation")
    elif operator == "%" and isinstance(left, str):
        check_printf(left, right)


def check_printf(fmt: str, args: Any) -> None:
    """`fmt % args` asks for no width or precision over MAX_NUMBER (`*` takes it from
    the arguments)."""
    starred = False
    for match in _PRINTF.finditer(fmt):
        for part in match.groups():
            if part == "*":
                starred = True
            elif part is not None:
                check_number(int(part), "a format width")
    if starred:
        for arg in args if isinstance(args, tuple) else (args,):
            check_number(arg, "a format width")


def check_format(fmt: str, args: Iterable[Any], kwargs: Mapping[str, Any]) -> None:
    """The same for `str.format`: widths in the specs, or in the arguments when a spec
    nests a field (`{:{width}}`)."""
    nested = False
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            nested = nested or "{" in spec
            for digits in _DIGITS.findall(spec):
                check_number(int(digits), "a format width")
    if nested:
        for arg in [*args, *kwargs.values()]:
            check_number(arg, "a format width")


# -- string methods and filters -----------------------------------------------------------


def _replaced(text: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    n = text.count(old) if old else len(text) + 1
    if _is_int(count) and count >= 0:
        n = min(n, count)
    return len(text) + n * max(len(new) - len(old), 0)


def _joined(items: Any, sep: Any, limits: RenderLimits) -> int:
    n = len(items) if isinstance(items, _SIZED) else 0
    return size(items, limits.max_chars) + len(str(sep)) * max(n - 1, 0)


def check_str_method(text: str, name: str, args: tuple[Any, ...], limits: RenderLimits) -> None:
    """Refuse a string method call whose result would be over the bounds."""
    if name in ("center", "ljust", "rjust", "zfill", "expandtabs"):
        for arg in args:
            check_number(arg, f"the width given to {name}()")
        if name == "expandtabs" and args and _is_int(args[0]):
            _refuse_size(len(text) * max(args[0], 1), limits, "a string")
    elif name == "replace" and len(args) >= 2:
        count = args[2] if len(args) > 2 else -1
        _refuse_size(_replaced(text, args[0], args[1], count), limits, "a string")
    elif name == "join" and args:
        _refuse_size(_joined(args[0], text, limits), limits, "a string")


def _indented(a: Mapping[str, Any], _: RenderLimits) -> int:
    text, width = str(a["s"]), a.get("width", 4)
    per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
    return len(text) + (text.count("\n") + 1) * per_line


def _wrapped(a: Mapping[str, Any], _: RenderLimits) -> int:
    text, width = str(a["s"]), a.get("width", 79)
    wrap = str(a.get("wrapstring") or "\n")
    spaces = len(text) - len("".join(text.split()))
    breaks = min(len(text), len(text) // max(width if _is_int(width) else 1, 1) + spaces)
    return len(text) + (breaks + 1) * len(wrap)


# filters whose numbers set a size (checked against MAX_NUMBER)
_NUMBER_FILTERS = frozenset({"batch", "center", "indent", "slice", "truncate", "wordwrap"})
# filter -> its arguments by name -> its result's size, estimated before it runs
_FILTER_SIZES: Mapping[str, Callable[[Mapping[str, Any], RenderLimits], int]] = {
    "replace": lambda a, _: _replaced(str(a["s"]), a["old"], a["new"], a.get("count")),
    "join": lambda a, limits: _joined(a["value"], a.get("d", ""), limits),
    "indent": _indented,
    "wordwrap": _wrapped,
}


def guard_filter(name: str, func: Callable[..., Any], limits: RenderLimits) -> Callable[..., Any]:
    """`func` (a jinja filter) under the bounds: its size-setting numbers checked, its
    result's size estimated first where the filter multiplies it, checked after."""
    try:
        signature: inspect.Signature | None = inspect.signature(func)  # of the sync filter
    except (TypeError, ValueError):
        signature = None
    # jinja's async-capable filters take an eval context their sync function does not
    skip = int(_pass_arg(func) and not _pass_arg(inspect.unwrap(func)))
    estimate = _FILTER_SIZES.get(name)
    checks_arguments = estimate is not None or name in _NUMBER_FILTERS or name == "format"

    @functools.wraps(func)  # keeps jinja's pass_context / pass_environment marks
    def guarded(*args: Any, **kwargs: Any) -> Any:
        tick()
        if checks_arguments and signature is not None:
            try:
                bound = signature.bind(*args[skip:], **kwargs)
            except TypeError:
                return func(*args, **kwargs)  # the filter itself says what is wrong
            given = bound.arguments
            if name == "join" and not isinstance(given.get("value"), _SIZED):
                given["value"] = list(given["value"])  # an iterator: count it, join the list
                args, kwargs = (*args[:skip], *bound.args), bound.kwargs
            if name in _NUMBER_FILTERS:
                for key, value in given.items():
                    if key not in ("value", "s"):  # the data filtered, not a size
                        check_number(value, f"the {key} given to the {name} filter")
            if name == "format":
                check_printf(str(given["value"]), given.get("args", ()))
            if estimate is not None:
                _refuse_size(estimate(given, limits), limits, f"the result of the {name} filter")
        return check_value(func(*args, **kwargs), limits, f"the result of the {name} filter")

    return guarded


def _pass_arg(func: Callable[..., Any]) -> bool:
    """Whether jinja passes `func` a context, eval context or environment first."""
    return getattr(func, "jinja_pass_arg", None) is not None
