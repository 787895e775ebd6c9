"""How a BLT run is accounted: the Gaussian mechanism at the min-sep sensitivity.

Amplified BandMF (`cocoon_ckpt.dp.accounting`) rests on C being b-banded: with cyclic
Poisson sampling over b partitions, the steps of one round touch disjoint columns and
the run splits into ceil(n / b) independent Poisson-subsampled Gaussians
(Choquette-Choo et al., "Amplified Banded Matrix Factorization", 2023, Thm. 4). A BLT's
C is dense below the diagonal, so no such split exists, and this library claims no
amplification by sampling for it. This is jax_privacy's choice too: its amplified
accounting (`accounting.amplified_bandmf_event`, `execution_plan.BandMFConfig`) is for
banded strategies only, and its BLT losses (`buffered_toeplitz.LossFn.build_min_sep`)
are those of the unamplified mechanism (McMahan et al., "Hassle-free BLT", 2024;
Dvijotham et al. 2024).

The whole run is then one Gaussian mechanism on the stacked clipped gradients G:
released C G + Z with Z ~ N(0, (sigma clip)^2), and one example changes C G by at most
sens * clip in Frobenius norm, where sens is C's sensitivity under b-min-separated
participation (`minsep_sensitivity_squared`; the cyclic sampler puts one example's
steps b apart at least, and at most ceil(n / b) of them). Adaptive choice of gradients
does not change this (Denisov et al., "Improved DP for SGD via optimal private linear
operators on adaptive streams", 2022, Thm. 2.1). Poisson sampling only removes
participations, so each sampling outcome is a Gaussian mechanism with sensitivity at
most sens, and the mixture is no less private (joint convexity of the hockey-stick
divergence): dropping amplification is conservative, never optimistic.

So epsilon is that of `GaussianDpEvent(sigma / sens)`, composed once, whatever the
number of steps. It is exact at the end of the run; before the end the steps not yet
released only lower the real loss, and the reported epsilon stays an upper bound.
Adjacency is the library's (zero-out / replace-one as documented for BandMF; sens
counts one example's contributions of norm at most clip).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import dp_accounting
from scipy import optimize
from scipy.stats import norm

if TYPE_CHECKING:
    # only its methods are called: the accountant imports this module without torch
    from cocoon_ckpt.dp.blt.strategy import BLT

__all__ = ["accounting_sensitivity", "blt_dp_event", "blt_epsilon", "blt_noise_multiplier_for"]


def accounting_sensitivity(blt: BLT, steps: int, bands: int) -> float:
    """The L2 sensitivity the accountant divides sigma by, in units of clip.

    Args:
        blt: the strategy (its C at largest column norm 1).
        steps: n, the run's steps; must equal `blt.steps` (C's scale depends on it).
        bands: b, the cyclic Poisson sampler's partitions: participations are b-min-
            separated, at most ceil(n / b) of them.

    Raises:
        ValueError: steps or bands disagree with the strategy or are out of range.
    """
    if steps != blt.steps:
        raise ValueError(
            f"steps={steps} but the BLT was built for steps={blt.steps}: fit it for the "
            "run's steps (its scale and sensitivity depend on them)"
        )
    if not isinstance(bands, int) or bands < 1:
        raise ValueError(f"bands={bands!r} must be an integer >= 1")
    return blt.sensitivity(bands)


def blt_dp_event(noise_multiplier: float, sensitivity: float) -> dp_accounting.DpEvent:
    """The run's event: one Gaussian mechanism with noise multiplier sigma / sens.

    Args:
        noise_multiplier: sigma, the std of z_t in units of clip.
        sensitivity: `accounting_sensitivity(...)`, >= 1 for any C at column norm 1.
    """
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier={noise_multiplier} must be > 0")
    if not (sensitivity > 0 and math.isfinite(sensitivity)):
        raise ValueError(f"sensitivity={sensitivity} must be > 0")
    return dp_accounting.GaussianDpEvent(noise_multiplier / sensitivity)


def _delta(mu: float, eps: float) -> float:
    # The Gaussian mechanism's exact privacy profile at mu = sens / sigma (Balle and
    # Wang, "Improving the Gaussian mechanism", 2018, Thm. 8).
    return float(norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu))


def blt_epsilon(noise_multiplier: float, sensitivity: float, delta: float) -> float:
    """epsilon at `delta` of `blt_dp_event`, exact (no discretisation), 0 if even
    epsilon = 0 meets `delta`.

    Args:
        noise_multiplier: sigma (clip units).
        sensitivity: `accounting_sensitivity(...)`.
        delta: in (0, 1).
    """
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must lie in (0, 1)")
    mu = 1.0 / blt_dp_event(noise_multiplier, sensitivity).noise_multiplier
    if _delta(mu, 0.0) <= delta:
        return 0.0
    hi = 1.0
    while _delta(mu, hi) > delta:
        hi *= 2
    return float(optimize.brentq(lambda e: _delta(mu, e) - delta, 0.0, hi, xtol=1e-12))


def blt_noise_multiplier_for(target_epsilon: float, sensitivity: float, delta: float) -> float:
    """The smallest sigma with `blt_epsilon(sigma, sensitivity, delta) <= target_epsilon`
    (to 1e-9 relative, rounded up): sensitivity times the Gaussian mechanism's sigma."""
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon={target_epsilon} must be > 0")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must lie in (0, 1)")
    lo, hi = 1e-3, 1.0
    while _delta(1.0 / hi, target_epsilon) > delta:
        lo, hi = hi, 2 * hi
    s = optimize.brentq(lambda x: _delta(1.0 / x, target_epsilon) - delta, lo, hi, rtol=1e-12)
    return float(s * (1 + 1e-9) * sensitivity)
