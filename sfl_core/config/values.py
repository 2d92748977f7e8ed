"""Field checks a config section is written with: the run config's core keys
(:mod:`sfl_core.config.run`) and each method's own section (``sfl_core/methods/<method>/config.py``).

Each converter takes the raw value and ``fail``; ``fail(what)`` reports ``expected <what>``
(:func:`sfl_core.config.fields.checked` makes one a pydantic validator). The upper-case names
are the validators most fields use, ready for ``Annotated[int, POSITIVE_INTEGER]``.
"""

from __future__ import annotations

from typing import Any

from sfl_core.config.fields import Conv, Fail, checked, number
from sfl_core.wire.codec import CODECS, TOPK_PATTERN, is_codec


def number_in(lo: float | None = None, lo_open: bool = True, hi: float | None = None,
           hi_open: bool = False, what: str = "a number") -> Conv:
    def conv(v: Any, fail: Fail) -> float:
        x = number(v)
        if x is None:
            fail(what)
        x = float(x)
        if lo is not None and (x < lo or (lo_open and x == lo)):
            fail(what)
        if hi is not None and (x > hi or (hi_open and x == hi)):
            fail(what)
        return x
    return conv


def auto_or_share(v: Any, fail: Fail) -> "str | float":
    """``"auto"`` (the method decides) or a number in [0, 1)."""
    if v == "auto":
        return "auto"
    x = number(v)
    if x is None or not 0 <= x < 1:
        fail('"auto" or a number in [0, 1)')
    return float(x)


def integer_in(lo: int, hi: int | None = None, what: str = "an integer") -> Conv:
    def conv(v: Any, fail: Fail) -> int:
        x = number(v)
        if x is None or (isinstance(x, float) and not x.is_integer()):
            fail(what)
        x = int(x)
        if x < lo or (hi is not None and x > hi):
            fail(what)
        return x
    return conv


positive_number = number_in(0.0, what="a positive number")


nonneg_number = number_in(0.0, lo_open=False, what="a non-negative number")


positive_integer = integer_in(1, what="a positive integer")


nonneg_integer = integer_in(0, what="a non-negative integer")


def nonempty_string(v: Any, fail: Fail) -> str:
    if not isinstance(v, str) or not v.strip():
        fail("a non-empty string")
    return v


def one_of(*choices: str) -> Conv:
    def conv(v: Any, fail: Fail) -> str:
        if v not in choices:
            fail("one of " + ", ".join(repr(c) for c in choices))
        return v
    return conv


def optional(conv: Conv) -> Conv:
    """``None`` (YAML ``null`` or ``~``) means 'use the automatic value'."""
    def wrapped(v: Any, fail: Fail) -> Any:
        return None if v is None else conv(v, fail)
    return wrapped


def boolean(v: Any, fail: Fail) -> bool:
    if not isinstance(v, bool):
        fail("true or false")
    return v


def split_points(v: Any, fail: Fail) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        fail("a non-empty list of split points (integers >= 1), or null")
    if sorted(set(v)) != list(v):
        fail("strictly increasing split points")
    return tuple(v)


def positive_integers(v: Any, fail: Fail) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v):
        fail("a non-empty list of positive integers, or null")
    return tuple(v)


def codec_list(v: Any, fail: Fail) -> tuple[str, ...] | None:
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not v or not all(is_codec(c) for c in v):
        fail("a non-empty list of codecs (" + ", ".join(CODECS) + f" or {TOPK_PATTERN}), or null")
    return tuple(v)


POSITIVE_NUMBER = checked(positive_number)
OPTIONAL_POSITIVE_NUMBER = checked(optional(positive_number))
POSITIVE_INTEGER = checked(positive_integer)
OPTIONAL_POSITIVE_INTEGER = checked(optional(positive_integer))
NONNEG_INTEGER = checked(nonneg_integer)
BOOLEAN = checked(boolean)
NONEMPTY_STRING = checked(nonempty_string)
FRACTION = checked(number_in(0.0, lo_open=False, hi=1.0, what="a number in [0, 1]"))
AT_LEAST_0 = checked(number_in(0.0, lo_open=False, what="a number >= 0"))
BATCH = checked(integer_in(1, 4096, what="an integer from 1 to 4096"))
OPTIONAL_BATCH = checked(optional(integer_in(1, 4096, what="an integer from 1 to 4096")))
UNIT_OPEN = checked(number_in(0.0, lo_open=False, hi=1.0, hi_open=True, what="a number in [0, 1)"))
