"""Calibration: the smallest noise multiplier that meets a target epsilon.

The search runs on a 10x coarser PLD grid than the reported accounting (each trial
sigma's one-round PLD builds about 10x faster) and checks its answer with the reported
accounting (`cocoon_ckpt.dp.accounting.epsilon`), so the answer always meets the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from scipy import optimize

from cocoon_ckpt.dp._validate import SIGMA_MAX, SIGMA_MIN
from cocoon_ckpt.dp.accounting.amplified import epsilon, validate_arguments
from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.accounting.pld_composition import OneRound
from cocoon_ckpt.dp.blt.accounting import blt_epsilon, blt_noise_multiplier_for
from cocoon_ckpt.errors import ConfigError, PrivacyBudgetError

__all__ = ["SIGMA_MAX", "SIGMA_MIN", "blt_noise_multiplier", "noise_multiplier_for"]

# SIGMA_MIN: the smallest sigma calibration returns (and a config takes): below it the PLD
# discretisation grows without bound, and a target that needs it is no real privacy.
# SIGMA_MAX: the largest; a target that needs more is refused (`dp._validate` says why).

#: `noise_multiplier_for` searches on this grid: 10x coarser than the reported one, so
#: each trial sigma's one-round PLD builds about 10x faster.
_SEARCH_INTERVAL = 1e-3


def _secant(fn: Callable[[float], float], target: float, sigma: float, tol: float) -> float | None:
    """sigma with fn(sigma) = target by the secant method on (log sigma, log epsilon),
    where epsilon is close to a power of sigma; None when it does not converge."""
    xs = [math.log(sigma), math.log(sigma) + 0.02]
    fs = [math.log(max(fn(math.exp(x)), 1e-300)) - math.log(target) for x in xs]
    for _ in range(20):
        if not all(map(math.isfinite, fs)) or fs[-1] == fs[-2]:
            return None
        x = xs[-1] - fs[-1] * (xs[-1] - xs[-2]) / (fs[-1] - fs[-2])
        # within the accepted range: a secant step to 1e21 overflowed RDP's composition
        x = min(max(x, math.log(SIGMA_MIN)), math.log(SIGMA_MAX))
        if abs(x - xs[-1]) < tol:
            return math.exp(x)
        xs.append(x)
        fs.append(math.log(max(fn(math.exp(x)), 1e-300)) - math.log(target))
    return None


def _solve(searched: Callable[..., float], target: float, method: AccountingMethod) -> float | None:
    """Two stages for PLD: a 10x coarser grid still (each trial about 10x cheaper) to
    get close, then the search grid from there; one stage for RDP."""
    if method is AccountingMethod.PLD:
        rough = _secant(lambda s: searched(s, 10 * _SEARCH_INTERVAL), target, 1.0, 1e-3)
        return _secant(searched, target, rough or 1.0, 1e-5)
    return _secant(searched, target, 1.0, 1e-5)


def noise_multiplier_for(
    target_epsilon: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    bands: int,
    delta: float,
    method: str = "pld",
) -> float:
    """The smallest sigma >= 0.3 whose epsilon after `steps` steps is <= `target_epsilon`
    (at most 1e8, `SIGMA_MAX`: a target that needs more is refused).

    PLD: the search runs on a 10x coarser pessimistic grid, whose epsilon lies just
    above the reported one (measured: the sigma found is within 0.2% of the reported
    accounting's own smallest sigma); the answer is then checked with the reported
    accounting (`epsilon`) and raised by 0.1% steps until it meets the target, so
    `epsilon(noise_multiplier_for(e, ...), ...) <= e` always holds. About 1 s on
    bench/accounting.py's targets (each trial's one-round PLD built grid-at-once, its
    epsilon loop compiled: `dp.accounting.pld_composition`), where dp-accounting's
    calibration on the fine grid took 10-30 s.

    Raises:
        ValueError: an argument is out of range.
        PrivacyBudgetError: no sigma in [0.3, 1e8] reaches the target (below 0.3 the
            PLD discretisation grows without bound; above 1e8, more noise than any job
            needs: `dp._validate.SIGMA_MAX`).
    """
    if not target_epsilon > 0:
        raise ConfigError(f"target_epsilon={target_epsilon} must be > 0")
    validate_arguments(None, dataset_size, batch_size, steps, bands, delta)
    m = AccountingMethod(method)
    q = batch_size * bands / dataset_size
    count = math.ceil(steps / bands)

    def reported(sigma: float) -> float:
        return epsilon(sigma, dataset_size, batch_size, steps, bands, delta, m.value)

    def searched(sigma: float, interval: float = _SEARCH_INTERVAL) -> float:
        if m is AccountingMethod.PLD:
            return OneRound(sigma, q, interval).epsilon(count, delta)
        return reported(sigma)

    def fail(why: str) -> PrivacyBudgetError:
        return PrivacyBudgetError(
            f"no noise_multiplier >= {SIGMA_MIN} reaches epsilon={target_epsilon} at "
            f"delta={delta} for {steps} steps: {why}"
        )

    def too_strict() -> PrivacyBudgetError:
        return PrivacyBudgetError(
            f"target_epsilon={target_epsilon} at delta={delta} for {steps} steps needs a "
            f"noise_multiplier above {SIGMA_MAX:g}, the largest accepted (epsilon there is "
            f"{reported(SIGMA_MAX):.3g}): ask for a larger target_epsilon"
        )

    if searched(SIGMA_MIN, 10 * _SEARCH_INTERVAL) <= target_epsilon:
        sigma = SIGMA_MIN  # the floor: any target this loose is met at sigma = 0.3
    else:
        found = _solve(searched, target_epsilon, m)
        if found is None:  # the secant lost its way: bracket and bisect (slower, sure)
            lo, hi = SIGMA_MIN, 1.0
            while searched(hi) > target_epsilon:
                if hi >= SIGMA_MAX:
                    raise too_strict()
                lo, hi = hi, min(2 * hi, SIGMA_MAX)
            x = optimize.brentq(
                lambda x: searched(math.exp(x)) - target_epsilon,
                math.log(lo),
                math.log(hi),
                xtol=1e-5,
            )
            found = math.exp(x)
        sigma = min(found * (1 + 1e-5), SIGMA_MAX)
    for _ in range(50):
        if reported(sigma) <= target_epsilon:
            return float(sigma)
        if sigma >= SIGMA_MAX:
            raise too_strict()
        sigma = min(sigma * 1.001, SIGMA_MAX)
    raise fail(f"the search's answer {sigma:g} does not meet it under the reported accounting")


def blt_noise_multiplier(target_epsilon: float, sensitivity: float, delta: float) -> float:
    """The smallest sigma >= 0.3 whose BLT run (one Gaussian at sigma / `sensitivity`,
    `dp.blt.accounting`) is within `target_epsilon` at `delta`: the closed-form
    Gaussian's, floored as `noise_multiplier_for` floors BandMF's, so a BLT job's
    calibrated sigma obeys the same rule.

    Args:
        target_epsilon: > 0.
        sensitivity: `blt.accounting.accounting_sensitivity(blt, steps, bands)`.
        delta: in (0, 1).
    """
    sigma = max(SIGMA_MIN, blt_noise_multiplier_for(target_epsilon, sensitivity, delta))
    if sigma > SIGMA_MAX:
        raise PrivacyBudgetError(
            f"target_epsilon={target_epsilon} at delta={delta} (BLT sensitivity "
            f"{sensitivity:g}) needs a noise_multiplier of {sigma:.3g}, above {SIGMA_MAX:g}, "
            "the largest accepted: ask for a larger target_epsilon"
        )
    if blt_epsilon(sigma, sensitivity, delta) > target_epsilon:
        raise PrivacyBudgetError(
            f"sigma={sigma:g} found for epsilon={target_epsilon} at delta={delta} "
            f"(BLT sensitivity {sensitivity:g}) does not meet it; report this as a bug"
        )
    return float(sigma)
