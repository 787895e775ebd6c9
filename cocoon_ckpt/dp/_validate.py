"""Argument checks of the config dataclasses: one definition per rule.

Each check raises `ConfigError` whose message names the field, the value and the rule,
e.g. "Expected JobConfig.lr=inf to be finite and > 0". JSON gives ints for floats and
never gives NaN as a string, but it does give strings, lists and booleans where numbers
belong: `true` is not a count and `"no"` is not a boolean.
"""

from __future__ import annotations

import math
from typing import Any

from cocoon_ckpt.errors import ConfigError

__all__ = [
    "MAX_COUNT",
    "MAX_STEPS",
    "boolean",
    "check",
    "integer",
    "positive_real",
    "real_between",
    "text",
]

#: Steps, bands, checkpoint intervals: a job of more steps than this is a typo
#: (2**31 steps of even 1 ms is 25 days of pure noise generation).
MAX_STEPS = 2**31 - 1
#: Examples, batch sizes, version counts.
MAX_COUNT = 2**48


def check(ok: bool, where: str, value: Any, rule: str) -> None:
    """Raise ConfigError "Expected {where}={value!r} to {rule}" unless `ok`."""
    if not ok:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise ConfigError(f"Expected {where}={shown} to {rule}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(where: str, value: Any, lo: int, hi: int) -> None:
    """An integer (not a bool) in [lo, hi]."""
    check(_is_int(value) and lo <= value <= hi, where, value, f"be an integer in [{lo}, {hi}]")


def positive_real(where: str, value: Any) -> None:
    """A finite number > 0."""
    ok = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0
    check(ok, where, value, "be finite and > 0")


def real_between(where: str, value: Any, lo: float, hi: float) -> None:
    """A number in the open interval (lo, hi)."""
    ok = (_is_int(value) or isinstance(value, float)) and lo < value < hi
    check(ok, where, value, f"lie in ({lo:g}, {hi:g})")


def boolean(where: str, value: Any) -> None:
    """true or false (not 0, 1 or a string)."""
    check(isinstance(value, bool), where, value, "be true or false")


def text(where: str, value: Any, choices: tuple[str, ...] | None = None) -> None:
    """A non-empty string, one of `choices` when given."""
    if choices is not None:
        check(value in choices and isinstance(value, str), where, value, f"be one of {choices}")
    else:
        check(isinstance(value, str) and value != "", where, value, "be a non-empty string")
