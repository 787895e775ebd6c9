"""The k-fold self-composition of one Poisson-subsampled Gaussian round's PLD, cached.

The epsilon is what dp-accounting's `PLDAccountant` gives for the event, bit for bit
(tests/cocoon_ckpt/test_accountant.py), but paid for once per distinct round count and
faster: the one-round PLD of the subsampled Gaussian (0.5-3.5 s to build here: a Python
loop over 10^5 grid points) is built once per (sigma, q), and the count-independent
parts of its k-fold self-composition (the Chernoff tail bounds' log-MGFs, which were
half of each composition, and the FFT of the one-round pmf) are cached beside it; each
new round count then costs one FFT power, the accountant's own compose and epsilon.
The one-round PLD itself is built by `dp.accounting.pld_gaussian` (the same PLD, ~6x
faster), and the composed PLD's epsilon, with the accountant's compose onto its identity
PLD, by the compiled replicas of `dp.accounting._pld_kernels`. A new round count at the
mlp example's settings costs about 40 ms (0.12-0.19 s before, 0.5-1.4 s from scratch).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_dist
from scipy import fft, signal, special

from cocoon_ckpt.dp.accounting._pld_kernels import epsilon_for_delta, int_power, prefix_to_truncate
from cocoon_ckpt.dp.accounting.pld_gaussian import subsampled_gaussian

__all__ = ["PLD_INTERVAL", "TAIL_MASS", "OneRound", "SelfComposer", "one_round", "pld_epsilon"]


#: PLDAccountant's default grid (the reported epsilon's) and the tail mass that
#: `PrivacyLossDistribution.self_compose` truncates by default.
PLD_INTERVAL = 1e-4
TAIL_MASS = 1e-15


class SelfComposer:
    """One pmf of a one-round PLD, with what its k-fold self-composition needs that does
    not depend on k. `compose(k)` equals `pmf.self_compose(k)` bit for bit: the same
    dp-accounting steps (`common.compute_self_convolve_bounds`, `common.self_convolve`,
    `DensePLDPmf.self_compose`) in the same order, on cached intermediate values."""

    def __init__(self, pmf: Any) -> None:
        self.pmf = pmf
        self.dense = type(pmf) is pld_pmf.DensePLDPmf
        if not self.dense:
            return
        probs = pmf._probs
        n = len(probs)
        orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
        self.log_mgfs = [
            (order, special.logsumexp(np.arange(n) * order, b=probs)) for order in orders
        ]
        self.ffts: dict[int, np.ndarray] = {}

    def _bounds(self, num_times: int) -> tuple[int, int]:
        upper = (len(self.pmf._probs) - 1) * num_times
        lower = 0
        for order, log_mgf_value in self.log_mgfs:
            bound = (num_times * log_mgf_value + math.log(2 / TAIL_MASS)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        return lower, upper

    def compose(self, num_times: int) -> Any:
        pmf = self.pmf
        if not self.dense:
            return pmf.self_compose(num_times, TAIL_MASS)
        probs = pmf._probs
        lower, upper = self._bounds(num_times)
        output_len = upper - lower + 1
        fast_len = fft.next_fast_len(max(output_len, len(probs)))
        spectrum = self.ffts.get(fast_len)
        if spectrum is None:
            if len(self.ffts) >= 4:  # a few sizes: neighbouring counts share them
                self.ffts.pop(next(iter(self.ffts)))
            spectrum = self.ffts[fast_len] = fft.fft(probs, fast_len)
        out = np.real(fft.ifft(int_power(spectrum, num_times)))
        out = _rolled_prefix(out, lower, output_len)
        inf_prob = TAIL_MASS - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(
            pmf._discretization,
            pmf._lower_loss * num_times + lower,
            out,
            inf_prob,
            pmf._pessimistic_estimate,
        )


def _rolled_prefix(values: np.ndarray, shift: int, length: int) -> np.ndarray:
    """`np.array(np.roll(values, -shift)[:length])` (the same values: only copied),
    copying `length` values instead of rolling all of them first."""
    length = min(length, len(values))
    start = shift % len(values)
    head = values[start : start + length]
    if len(head) == length:
        return np.array(head)
    return np.concatenate((head, values[: length - len(head)]))


def _onto_identity(pmf: pld_pmf.DensePLDPmf) -> pld_pmf.DensePLDPmf:
    """The identity PLD's pmf composed with `pmf`, as `PLDAccountant` composes an event
    onto its identity PLD: `DensePLDPmf.compose` with `_truncate_tails` at TAIL_MASS, the
    same steps, its prefix walks compiled."""
    identity = _identity_pmf(pmf._discretization)
    probs = signal.fftconvolve(identity._probs, pmf._probs)
    infinity_mass = (
        identity._infinity_mass + pmf._infinity_mass - identity._infinity_mass * pmf._infinity_mass
    )
    left_idx = prefix_to_truncate(probs, TAIL_MASS / 2)
    right_idx = len(probs) - prefix_to_truncate(np.flip(probs), TAIL_MASS / 2)
    right_idx = max(right_idx, left_idx + 1)
    left_mass = np.sum(probs[:left_idx])
    right_mass = np.sum(probs[right_idx:])
    truncated = probs[left_idx:right_idx]
    truncated[0] += left_mass
    return pld_pmf.DensePLDPmf(
        pmf._discretization,
        identity._lower_loss + pmf._lower_loss + left_idx,
        truncated,
        infinity_mass + right_mass,
        pmf._pessimistic_estimate,
    )


@functools.lru_cache(maxsize=4)
def _identity_pmf(interval: float) -> pld_pmf.DensePLDPmf:
    pmf = pld_dist.identity(value_discretization_interval=interval)._pmf_remove
    return pmf.to_dense_pmf()


class OneRound:
    """The PLD of one Poisson-subsampled Gaussian round, as PLDAccountant builds it."""

    def __init__(self, noise_multiplier: float, q: float, interval: float) -> None:
        self.interval = interval
        one = subsampled_gaussian(noise_multiplier, q, interval)
        self.symmetric = one._symmetric
        self.remove = SelfComposer(one._pmf_remove)
        self.add = None if self.symmetric else SelfComposer(one._pmf_add)

    def epsilon(self, count: int, delta: float) -> float:
        """epsilon of `count` rounds at `delta`: `PLDAccountant`'s, bit for bit."""
        if not (self.remove.dense and (self.add is None or self.add.dense)):
            return self._epsilon_by_accountant(count, delta)
        # PrivacyLossDistribution.get_epsilon_for_delta of the composition onto the
        # identity PLD (the compose truncates, which moves the last bits): the larger of
        # the two adjacencies' epsilons.
        eps = epsilon_for_delta(_onto_identity(self.remove.compose(count)), delta)
        if self.add is not None:
            eps = max(eps, epsilon_for_delta(_onto_identity(self.add.compose(count)), delta))
        return float(eps)

    def _epsilon_by_accountant(self, count: int, delta: float) -> float:
        remove = self.remove.compose(count)
        composed = (
            pld_dist.PrivacyLossDistribution(remove)
            if self.add is None
            else pld_dist.PrivacyLossDistribution(remove, self.add.compose(count))
        )
        # PLDAccountant composes the event onto its identity PLD; so do we (the compose
        # convolves and truncates, which moves the last bits).
        acc = pld_dist.identity(value_discretization_interval=self.interval).compose(composed)
        return float(acc.get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=8)
def one_round(noise_multiplier: float, q: float, interval: float) -> OneRound:
    return OneRound(noise_multiplier, q, interval)


def pld_epsilon(
    noise_multiplier: float, q: float, count: int, delta: float, interval: float
) -> float:
    return one_round(noise_multiplier, q, interval).epsilon(count, delta)
