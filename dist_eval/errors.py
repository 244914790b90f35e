"""Errors the user can fix, warnings, and the one-line shortening of messages.

A :class:`UsageError` names the parameter it is about. The Python API shows it as the
argument (``label_column='y': no such column ...``); the CLI, which runs inside
:func:`flag_names`, as the flag (``--label-column y: no such column ...``).
"""
from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import unicodedata
from typing import Any, Iterator, Optional, TextIO, Tuple

_NO_VALUE = object()
_AS_FLAGS = contextvars.ContextVar("dist_eval_errors_as_flags", default=False)
# API parameters whose CLI flag is not "--" + the name with dashes (the CLI reads the
# tokenizer from the model folder)
_FLAG_OF = {"model_dir": "--model", "data": "--data-files", "tokenizer": "--model"}
# Set when this process is told to stop (SIGINT/SIGTERM, dist_eval.cli): a scheduler's cancel
# signals every process of the job, the rank's own p2pd too, so the requests it cuts short
# ("stream reset") say nothing about the servers, and are not reported as their failures.
stopping = threading.Event()


class UsageError(Exception):
    """A problem with the user's arguments, data, model or environment.

    The message names the argument, what was expected, what arrived and the fix.
    ``param`` (and ``value``) name the argument: the message then starts with it, as
    the API argument or, inside :func:`flag_names`, as the CLI flag.
    """

    def __init__(self, message: str, *, param: Optional[str] = None, value: Any = _NO_VALUE,
                 names: Tuple[str, ...] = ()):
        super().__init__(message)
        self.message, self.param, self.value, self.names = message, param, value, names

    @property
    def detail(self) -> str:
        """The message; ``{0}``, ``{1}``... in it: the parameters ``names`` names, as the API or
        the CLI spells them (formatted when shown, so the CLI's flag_names applies).
        """
        return self.message.format(*map(param_name, self.names)) if self.names else self.message

    def __str__(self) -> str:
        if self.param is None:
            return self.detail
        return f"{param_name(self.param, self.value)}: {self.detail}"


def param_name(param: str, value: Any = _NO_VALUE) -> str:
    """``param=value`` for the Python API; ``--param value`` for the CLI (see :func:`flag_names`)."""
    if _AS_FLAGS.get():
        flag = _FLAG_OF.get(param, "--" + param.replace("_", "-"))
        if value is _NO_VALUE:
            return flag
        if isinstance(value, (list, tuple)):
            value = " ".join(map(str, value))
        elif isinstance(value, float):
            value = f"{value:g}"  # what was typed: 10, not 10.0
        return f"{flag} {value}"
    return param if value is _NO_VALUE else f"{param}={value!r}"


@contextlib.contextmanager
def flag_names() -> Iterator[None]:
    """Inside: errors name CLI flags instead of API arguments (the CLI runs in it)."""
    token = _AS_FLAGS.set(True)
    try:
        yield
    finally:
        _AS_FLAGS.reset(token)


def printable(text: Any) -> str:
    r"""``str(text)`` with every control character (C0, DEL, C1; Unicode format and separator
    characters such as bidi overrides) written as its escape (ESC as ``\x1b``, a right-to-left
    override as ``\u202e``): a peer's self-announced strings shown on a terminal cannot drive it
    (colours, cursor moves, titles).
    """
    return "".join(ch.encode("unicode_escape").decode("ascii") if _is_control(ch) else ch for ch in str(text))


def _is_control(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line (runs of whitespace collapsed), cut after ``limit`` characters ("..." marks a cut)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def short_error(error: BaseException, limit: int = 200) -> str:
    """``TypeName: message`` on one line, the message cut after ``limit`` characters."""
    return f"{type(error).__name__}: {one_line(str(error), limit)}"


def warn(message: str, *, label: str = "dist_eval", stream: Optional[TextIO] = None) -> None:
    """One ``<label>: warning: ...`` line on ``stream`` (stderr by default; shown in --quiet mode too)."""
    print(f"{label}: warning: {message}", file=stream or sys.stderr, flush=True)
