"""Bounds on what rendering a chat template may cost (tokenizer worker).

A chat template comes in the model folder, from whoever published it. transformers renders it in
Jinja's sandbox, which keeps it away from Python's internals but not from the CPU or memory: a
template `{{ 'x' * 10**10 }}` built a 10 GB string, and two nested loops over `range(99999)` ran for
ever; either stalled the tokenizer worker until its heartbeat timed out (every chat request then
failed, and other clients' requests with it). `install()` makes transformers compile templates in
`BoundedSandbox`: a repetition (`*`) may build at most MAX_REPEAT_ITEMS characters or items, a power
(`**`) and a product of integers build at most MAX_INT_BITS bits, and a render ends after MAX_RENDER_SECONDS (SIGALRM in
the main thread, else a trace function that checks the time while the template's Python code runs). Either is a TemplateError, which the
worker answers as a 400 for that request.
"""

from __future__ import annotations

import functools
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT_ITEMS = 1 << 22  # 4 Mi characters (a prompt of the longest context is a few MB)
MAX_INT_BITS = 1 << 16  # an integer a product or a power builds (10 ** 10 ** 10 chained: for ever)
MAX_RENDER_SECONDS = 5.0  # Qwen's templates render a 10,000-message chat in well under a second

logger = logging.getLogger("mllmd.template")


class TemplateLimitError(TemplateError):
    """The chat template went past a bound of this module."""


def _alarm_is_free() -> bool:
    """SIGALRM can time this render: the main thread, and no one else's handler or timer (pytest-timeout
    has one in tests)."""
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


@contextmanager
def render_deadline(seconds: float | None = None, alarm: bool = True) -> Iterator[None]:
    """Raise TemplateLimitError in the Python code run within, in this thread, once `seconds`
    (MAX_RENDER_SECONDS) passed: by SIGALRM where `alarm` and it is free (the tokenizer worker's
    main thread, where generation requests render), else by a trace function checked every 16
    function calls and lines of the template's code (the thread's previous one comes back)."""
    seconds = MAX_RENDER_SECONDS if seconds is None else seconds
    if alarm and _alarm_is_free():  # no cost while the render runs (the trace below made it 3-4x slower)
        def expire(signum: int, frame: FrameType | None) -> None:
            raise TemplateLimitError(f"the chat template ran for more than {seconds:g} s")

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        return
    end = time.monotonic() + seconds
    count = 0

    def check(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        count += 1
        if not count & 15 and time.monotonic() > end:
            raise TemplateLimitError(f"the chat template ran for more than {seconds:g} s")
        return check

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        # every call is checked; lines only in the template's own code, where its loops spin (a
        # line trace of Jinja's runtime and of Python's helpers made a render 4x slower)
        check(frame, event, arg)
        return check if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


class BoundedTemplate(Template):
    """A template whose render (whole or streamed) stops at MAX_RENDER_SECONDS."""

    def render(self, *args: Any, **kwargs: Any) -> str:
        with render_deadline():
            return super().render(*args, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[str]:
        with render_deadline(alarm=False):  # the consumer runs between its items: no alarm over them
            yield from super().generate(*args, **kwargs)


class _BoundedFilters(dict[str, Any]):
    """The environment's filters, each checked for an integer argument past MAX_REPEAT_ITEMS when a
    template takes it (compiled templates look filters up by `environment.filters[name]` as they
    render, so filters transformers adds after the environment is built, tojson among them, are
    checked too; `get`, which the compiler uses, answers the filter itself)."""

    def __getitem__(self, name: str) -> Any:
        f = super().__getitem__(name)

        @functools.wraps(f)  # keeps jinja_pass_arg: context / environment first, as the compiler decided
        def bounded(*args: Any, **kwargs: Any) -> Any:
            _check_sizes(f"the filter {name}", args, kwargs)
            return f(*args, **kwargs)

        return bounded


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with `*`, `**` and `%` checked (intercepted operators are also never
    folded into constants when the template compiles, where `10 ** 10 ** 10` would run for ever), and
    the calls, filters and str.format that take a size (`'x'.ljust(n)`, `center(n)`, `tojson(indent=n)`,
    `'{:>n}'.format(...)`, `'%ns' % ...`) refused one past MAX_REPEAT_ITEMS."""

    intercepted_binops = frozenset({"*", "**", "%"})
    template_class = BoundedTemplate

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.filters = _BoundedFilters(self.filters)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_REPEAT_ITEMS:
                    raise TemplateLimitError(f"the chat template repeats a value into more than {MAX_REPEAT_ITEMS} items")
            if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template builds an integer of more than {MAX_INT_BITS} bits")
        if operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > MAX_INT_BITS:
                raise TemplateLimitError(f"the chat template builds an integer of more than {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):  # printf-style: a width or precision is a size
            _check_format(left, right if isinstance(right, (tuple, list)) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        if isinstance(getattr(__obj, "__self__", None), str) and getattr(__obj, "__name__", "") in _STR_SIZED:
            _check_sizes(f"str.{__obj.__name__}()", args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def bounded(*args: Any, **kwargs: Any) -> str:
            _check_format(value.__self__, args, kwargs)
            return str(wrapped(*args, **kwargs))

        return bounded


# str methods whose integer argument is the size of what they build
_STR_SIZED = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})
# a width or precision of ten million characters or more, in a format string; one taken from the
# arguments ('%*s', '{:{}}')
_HUGE_NUMBER = re.compile(r"\d{8,}")
_WIDTH_FROM_ARGS = re.compile(r"%[-#0 +]*\*|%[-#0 +]*\d*\.\*|\{[^{}]*\{")


def _check_sizes(what: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    for v in (*args, *kwargs.values()):
        if _is_int(v) and abs(v) > MAX_REPEAT_ITEMS:
            raise TemplateLimitError(f"the chat template passes {what} an integer over {MAX_REPEAT_ITEMS}")


def _check_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if _HUGE_NUMBER.search(fmt):
        raise TemplateLimitError(f"the chat template formats with a width over {MAX_REPEAT_ITEMS}")
    if _WIDTH_FROM_ARGS.search(fmt):
        _check_sizes("a format's width", args, kwargs)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def install() -> bool:
    """Have transformers compile chat templates in BoundedSandbox (its compile cache emptied); False,
    logged, where this transformers does not build them as expected."""
    try:
        from transformers.utils import chat_template_utils as ctu

        if ctu.ImmutableSandboxedEnvironment is not BoundedSandbox:
            assert ctu.ImmutableSandboxedEnvironment is ImmutableSandboxedEnvironment
            ctu.ImmutableSandboxedEnvironment = BoundedSandbox  # type: ignore[misc]
            ctu._compile_jinja_template.cache_clear()
        return True
    except (ImportError, AttributeError, AssertionError):
        logger.warning("chat templates render without mllmd's time and size bounds: this transformers "
                       "does not compile them as mllmd expects")
        return False
