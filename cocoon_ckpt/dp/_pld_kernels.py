"""Compiled replicas of dp-accounting's two per-element Python loops over a composed PLD.

`epsilon_for_delta` is `pld_pmf._get_epsilon_for_delta` and `prefix_to_truncate` the
`_find_prefix_to_truncate` inside `pld_pmf._truncate_tails`: the same operations in the
same order, each addition, product, `exp` and `log` rounded on its own (numba,
`fastmath=False`), so they return the same float. In Python they walked up to 2 * 10^5
grid points per call (90 ms and 8 ms at the mlp example's settings; both run twice per
epsilon, once per adjacency); compiled, about 1 ms. `agree()` checks the replicas
against dp-accounting's loops once per process, and the callers fall back to the
Python loops where they do not agree (a libm whose `exp` numba does not call).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting.pld import pld_pmf
from numba import njit

__all__ = ["agree", "epsilon_for_delta", "prefix_to_truncate"]


@njit(nogil=True, fastmath=False, cache=True)
def _epsilon_for_delta(
    infinity_mass: float, upper_loss: float, step: float, probs: np.ndarray, delta: float
) -> float:
    # `probs` in ascending loss order, walked from the top as dp-accounting walks
    # np.flip(probs); the loss advances by repeated addition of `step`, as
    # itertools.count(upper_loss, step) does.
    if infinity_mass > delta:
        return math.inf
    mass_upper = infinity_mass
    mass_lower = 0.0
    loss = upper_loss
    for i in range(probs.shape[0] - 1, -1, -1):
        prob = probs[i]
        if (
            mass_upper > delta
            and mass_lower > 0
            and math.log((mass_upper - delta) / mass_lower) >= loss
        ):
            break
        mass_upper += prob
        mass_lower += math.exp(-loss) * prob
        if mass_upper >= delta and mass_lower == 0:
            return loss if loss > 0 else 0.0
        loss = loss + step
    if mass_upper <= mass_lower + delta:
        return 0.0
    return math.log((mass_upper - delta) / mass_lower)


@njit(nogil=True, fastmath=False, cache=True)
def _prefix_to_truncate(arr: np.ndarray, threshold: float) -> int:
    s = 0.0
    for i in range(arr.shape[0]):
        s += arr[i]
        if s > threshold:
            return i
    n: int = arr.shape[0]
    return n


def _python_epsilon(pmf: pld_pmf.DensePLDPmf, delta: float) -> float:
    return float(pmf.get_epsilon_for_delta(delta))


def epsilon_for_delta(pmf: pld_pmf.DensePLDPmf, delta: float) -> float:
    """`pmf.get_epsilon_for_delta(delta)`, the same float, compiled."""
    if not agree():
        return _python_epsilon(pmf, delta)
    return _compiled_epsilon(pmf, delta)


def _compiled_epsilon(pmf: pld_pmf.DensePLDPmf, delta: float) -> float:
    d = pmf._discretization
    upper_loss = (pmf._lower_loss + len(pmf._probs) - 1) * d
    probs = np.ascontiguousarray(pmf._probs, dtype=np.float64)
    return float(_epsilon_for_delta(float(pmf._infinity_mass), upper_loss, -d, probs, delta))


def prefix_to_truncate(arr: np.ndarray, threshold: float) -> int:
    """The longest prefix of `arr` whose running sum stays <= `threshold`."""
    if not agree():
        s = 0
        for i, val in enumerate(arr):
            s += val
            if s > threshold:
                return i
        return len(arr)
    found: int = _prefix_to_truncate(np.ascontiguousarray(arr, dtype=np.float64), threshold)
    return found


@functools.cache
def agree() -> bool:
    """Whether the compiled loops give dp-accounting's floats on this machine (checked
    once per process on a few thousand random grid points, about 50 ms)."""
    rng = np.random.default_rng(20261203)
    for n, lower in ((3000, -700), (2500, 0), (40, 5), (60, 745_000)):
        probs = rng.exponential(size=n)
        probs /= probs.sum()
        for inf_mass in (0.0, 1e-9):
            pmf = pld_pmf.DensePLDPmf(1e-3, lower, probs, inf_mass, True)
            for delta in (1e-5, 1e-3, 0.2):
                if _python_epsilon(pmf, delta) != _compiled_epsilon(pmf, delta):
                    return False
        for threshold in (1e-4, 0.3):
            s, want_i = 0.0, n
            for i, val in enumerate(probs):
                s += val
                if s > threshold:
                    want_i = i
                    break
            if _prefix_to_truncate(probs, threshold) != want_i:
                return False
    return True
