"""Compiled replicas of dp-accounting's two per-element Python loops over a composed PLD,
and of numpy's complex power by an integer.

`epsilon_for_delta` is `pld_pmf._get_epsilon_for_delta` and `prefix_to_truncate` the
`_find_prefix_to_truncate` inside `pld_pmf._truncate_tails`: the same operations in the
same order, each addition, product, `exp` and `log` rounded on its own (numba,
`fastmath=False`), so they return the same float. In Python they walked up to 2 * 10^5
grid points per call (90 ms and 8 ms at the mlp example's settings; both run twice per
epsilon, once per adjacency); compiled, about 1 ms. `int_power` is `z ** n` for a
complex array, the spectrum power of every self-composition: numpy's `npy_cpow` takes
each element through a generic call with branches (2.5-6.5 ms for 2 * 10^5 elements at
n = 20-38, twice per epsilon); the same binary exponentiation compiled, the same
products in the same order, takes 1-3 ms. `agree()` checks the replicas against
dp-accounting's loops and numpy's power once per process, and the callers fall back to
the originals where they do not agree (a libm whose `exp` numba does not call, a numpy
whose power multiplies in another order).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from dp_accounting.pld import pld_pmf
from numba import njit

__all__ = ["agree", "epsilon_for_delta", "int_power", "prefix_to_truncate"]

#: The exponents numpy raises a complex by binary exponentiation (npy_cpow); 2 goes
#: through `np.square`, which multiplies otherwise, and larger ones through `cpow`.
_POWERS = range(3, 100)


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


@njit(nogil=True, fastmath=False, cache=True)
def _int_power(z: np.ndarray, n: int, out: np.ndarray) -> None:
    # npy_cpow for an integer exponent 3 <= n < 100: a zero base gives +0, 3 is
    # unrolled as a * (a * a), larger ones go by binary exponentiation from 1 + 0j;
    # each complex product as cmul forms it (ar * br - ai * bi, ar * bi + ai * br).
    for i in range(z.shape[0]):
        ar = z[i].real
        ai = z[i].imag
        if ar == 0.0 and ai == 0.0:
            out[i] = complex(0.0, 0.0)
            continue
        if n == 3:
            sr, si = ar * ar - ai * ai, ar * ai + ai * ar
            out[i] = complex(ar * sr - ai * si, ar * si + ai * sr)
            continue
        rr, ri = 1.0, 0.0
        pr, pi = ar, ai
        mask = 1
        while True:
            if n & mask:
                rr, ri = rr * pr - ri * pi, rr * pi + ri * pr
            mask <<= 1
            if n < mask:
                break
            pr, pi = pr * pr - pi * pi, pr * pi + pi * pr
        out[i] = complex(rr, ri)


def int_power(z: np.ndarray, n: int) -> np.ndarray:
    """`z ** n` for a 1-d complex128 array and an int `n`, the same floats, compiled
    for 3 <= n < 100 (numpy's own otherwise)."""
    if n not in _POWERS or z.dtype != np.complex128 or z.ndim != 1 or not agree():
        return z**n
    out = np.empty_like(z)
    _int_power(np.ascontiguousarray(z), n, out)
    return out


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
    """Whether the compiled loops give dp-accounting's and numpy's floats on this
    machine (checked once per process on a few thousand random grid points and complex
    numbers, about 50 ms)."""
    rng = np.random.default_rng(20261203)
    z = rng.standard_normal(2000) * np.exp(rng.uniform(-30, 30, 2000))
    z = z + 1j * rng.standard_normal(2000)
    # zeros, extremes, and real bases whose imaginary zero carries a sign
    z[:6] = [0.0, -0.0, complex(-0.0, -0.0), 1e300, complex(1e200, -1e200), 1e-300]
    z[6:8] = [complex(3.0, -0.0), complex(-2.0, -0.0)]
    for n in (3, 4, 7, 38, 99):
        out = np.empty_like(z)
        _int_power(z, n, out)
        with np.errstate(all="ignore"):
            want = z**n
        if want.tobytes() != out.tobytes():
            return False
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
