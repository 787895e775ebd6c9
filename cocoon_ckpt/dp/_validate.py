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
    "SIGMA_MAX",
    "SIGMA_MIN",
    "boolean",
    "check",
    "integer",
    "noise_multiplier",
    "positive_real",
    "real_between",
    "text",
]

#: Steps, bands, checkpoint intervals: a job of more steps than this is a typo
#: (2**31 steps of even 1 ms is 25 days of pure noise generation).
MAX_STEPS = 2**31 - 1
#: Examples, batch sizes, version counts.
MAX_COUNT = 2**48

#: The smallest noise multiplier a config takes (and calibration returns). Below it the
#: PLD accountant's discretised privacy loss grows as 1/sigma^2: on the example job (N =
#: 2048, B = 32, b = 8, 50 steps) one composition took 0.9 s at 0.3, 4.9 s at 0.1, 15 s at
#: 0.05 and 62 s at 0.03, ran out of memory at 0.01 and overflowed at 1e-300, after the
#: job had trained. Epsilon there is 34 at 0.3 already: less noise is no real privacy.
SIGMA_MIN = 0.3
#: The largest noise multiplier a config takes. The longest job a config allows (2**31 - 1
#: steps, every example in every step) has epsilon 0.17 at delta 1e-5 at sigma 1e6 and
#: 0.0036 at 1e8 (RDP); on the example job both accountants report epsilon 0 from about
#: 1e5 on, so more noise buys no privacy the accounting can show. Beyond it sigma * clip
#: heads for float32's limit (3.4e38; 1e308 overflowed the noise and the accounting).
SIGMA_MAX = 1e8


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


def noise_multiplier(where: str, value: Any) -> None:
    """A noise multiplier sigma in [SIGMA_MIN, SIGMA_MAX] (see their comments: what the
    accountant composes, and more noise than any job needs)."""
    ok = (_is_int(value) or isinstance(value, float)) and SIGMA_MIN <= value <= SIGMA_MAX
    check(
        ok,
        where,
        value,
        f"lie in [{SIGMA_MIN:g}, {SIGMA_MAX:g}]: below, the accountant's composition "
        "grows without bound and the epsilon is no real privacy; above, the noise is more "
        "than any job needs",
    )


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
