"""Privacy accounting for amplified BandMF, composed with dp-accounting.

Under cyclic Poisson sampling over b partitions, b-banded MF with sensitivity-1 C is
accounted as a Poisson-subsampled Gaussian with q = B b / N, composed ceil(n / b)
times (Choquette-Choo et al., "Amplified Banded Matrix Factorization", 2023).
b = 1 is exactly DP-SGD's accounting.

The PLD epsilon is what dp-accounting's `PLDAccountant` gives for the event, bit for bit
(tests/cocoon_ckpt/test_accountant.py), but paid for once per distinct round count and
faster: the one-round PLD of the subsampled Gaussian (0.5-3.5 s to build here: a Python
loop over 10^5 grid points) is built once per (sigma, q), and the count-independent
parts of its k-fold self-composition (the Chernoff tail bounds' log-MGFs, which were
half of each composition, and the FFT of the one-round pmf) are cached beside it; each
new round count then costs one FFT power, the accountant's own compose and epsilon.
A checkpoint at a new round count costs 0.1-0.3 s instead of 0.5-1.4 s.
`noise_multiplier_for` searches on a 10x coarser PLD grid and checks the answer with
the reported accounting (see there).
"""

from __future__ import annotations

import enum
import functools
import math
import threading
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_dist
from scipy import fft, optimize, special

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.errors import PrivacyBudgetError

__all__ = ["Accountant", "AccountingMethod", "dp_event", "epsilon", "noise_multiplier_for"]


_SIGMA_MIN = 0.3


class AccountingMethod(enum.StrEnum):
    """Which dp-accounting accountant composes the events."""

    PLD = "pld"
    """Privacy loss distributions: tight."""
    RDP = "rdp"
    """Rényi DP: looser, faster."""


def _validate(
    noise_multiplier: float | None,
    dataset_size: int,
    batch_size: int,
    steps: int,
    bands: int,
    delta: float,
) -> None:
    if noise_multiplier is not None and not (
        noise_multiplier > 0 and math.isfinite(noise_multiplier)
    ):
        raise ValueError(f"noise_multiplier={noise_multiplier} must be > 0")
    if not isinstance(dataset_size, int) or dataset_size < 1:
        raise ValueError(f"dataset_size={dataset_size} must be an integer >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be an integer >= 1")
    if batch_size > dataset_size:
        raise ValueError(f"batch_size={batch_size} exceeds dataset_size={dataset_size}")
    if not isinstance(bands, int) or bands < 1:
        raise ValueError(f"bands={bands} must be an integer >= 1")
    if batch_size * bands > dataset_size:
        raise ValueError(
            f"batch_size * bands = {batch_size * bands} exceeds dataset_size={dataset_size}: "
            "the sampling rate q = batch_size * bands / dataset_size would exceed 1"
        )
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps} must be an integer >= 1")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta} must lie in (0, 1)")


def dp_event(
    noise_multiplier: float, dataset_size: int, batch_size: int, steps: int, bands: int
) -> dp_accounting.DpEvent:
    """The dp-accounting event of `steps` steps of amplified b-banded MF."""
    q = batch_size * bands / dataset_size
    count = math.ceil(steps / bands)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise_multiplier)),
        count,
    )


def _accountant(method: AccountingMethod) -> dp_accounting.PrivacyAccountant:
    if method is AccountingMethod.PLD:
        return pld.PLDAccountant()
    return rdp.RdpAccountant()


#: PLDAccountant's default grid (the reported epsilon's) and the tail mass that
#: `PrivacyLossDistribution.self_compose` truncates by default.
_PLD_INTERVAL = 1e-4
_TAIL_MASS = 1e-15


class _SelfComposer:
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
            bound = (num_times * log_mgf_value + math.log(2 / _TAIL_MASS)) / order
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
            return pmf.self_compose(num_times, _TAIL_MASS)
        probs = pmf._probs
        lower, upper = self._bounds(num_times)
        output_len = upper - lower + 1
        fast_len = fft.next_fast_len(max(output_len, len(probs)))
        spectrum = self.ffts.get(fast_len)
        if spectrum is None:
            if len(self.ffts) >= 4:  # a few sizes: neighbouring counts share them
                self.ffts.pop(next(iter(self.ffts)))
            spectrum = self.ffts[fast_len] = fft.fft(probs, fast_len)
        out = np.real(fft.ifft(spectrum**num_times))
        out = np.array(np.roll(out, -lower)[:output_len])
        inf_prob = _TAIL_MASS - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
        return pld_pmf.DensePLDPmf(
            pmf._discretization,
            pmf._lower_loss * num_times + lower,
            out,
            inf_prob,
            pmf._pessimistic_estimate,
        )


class _OneRound:
    """The PLD of one Poisson-subsampled Gaussian round, as PLDAccountant builds it."""

    def __init__(self, noise_multiplier: float, q: float, interval: float) -> None:
        self.interval = interval
        one = pld_dist.from_gaussian_mechanism(
            standard_deviation=noise_multiplier,
            value_discretization_interval=interval,
            sampling_prob=q,
        )
        self.symmetric = one._symmetric
        self.remove = _SelfComposer(one._pmf_remove)
        self.add = None if self.symmetric else _SelfComposer(one._pmf_add)

    def epsilon(self, count: int, delta: float) -> float:
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
def _one_round(noise_multiplier: float, q: float, interval: float) -> _OneRound:
    return _OneRound(noise_multiplier, q, interval)


def _pld_epsilon(
    noise_multiplier: float, q: float, count: int, delta: float, interval: float
) -> float:
    return _one_round(noise_multiplier, q, interval).epsilon(count, delta)


_epsilons: dict[tuple[Any, ...], float] = {}
# One composition at a time: the progress display and the checkpoint writer asking for
# the same new round count at once compute it once, the second waiting for the first.
_epsilons_lock = threading.Lock()


def _epsilon_cached(
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    compositions: int,
    bands: int,
    delta: float,
    method: AccountingMethod,
) -> float:
    # Keyed by ceil(steps / b), not steps: every step of one participation round has
    # the same epsilon, so a PLD composition is paid once per b steps.
    key = (noise_multiplier, dataset_size, batch_size, compositions, bands, delta, method)
    with _epsilons_lock:
        eps = _epsilons.get(key)
        if eps is None:
            q = batch_size * bands / dataset_size
            if method is AccountingMethod.PLD:
                eps = _pld_epsilon(noise_multiplier, q, compositions, delta, _PLD_INTERVAL)
            else:
                acc = _accountant(method)
                acc.compose(
                    dp_event(
                        noise_multiplier, dataset_size, batch_size, compositions * bands, bands
                    )
                )
                eps = float(acc.get_epsilon(delta))
            if len(_epsilons) >= 4096:
                _epsilons.pop(next(iter(_epsilons)))
            _epsilons[key] = eps
        return eps


def _epsilon_known(
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    compositions: int,
    bands: int,
    delta: float,
    method: AccountingMethod,
) -> float | None:
    key = (noise_multiplier, dataset_size, batch_size, compositions, bands, delta, method)
    return _epsilons.get(key)


def epsilon(
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    bands: int,
    delta: float,
    method: str = "pld",
) -> float:
    """epsilon at `delta` after `steps` steps.

    Args:
        noise_multiplier: sigma; the noise std is sigma * clip, C at sensitivity 1.
        dataset_size: N.
        batch_size: B, expected batch size.
        steps: n steps taken (>= 1).
        bands: b (1 = DP-SGD).
        delta: target delta in (0, 1).
        method: "pld" (tight) or "rdp".

    Raises:
        ValueError: an argument is out of range; the message names it.
    """
    _validate(noise_multiplier, dataset_size, batch_size, steps, bands, delta)
    return _epsilon_cached(
        float(noise_multiplier),
        dataset_size,
        batch_size,
        math.ceil(steps / bands),
        bands,
        float(delta),
        AccountingMethod(method),
    )


#: `noise_multiplier_for` searches on this grid: 10x coarser than the reported one, so
#: each trial sigma's one-round PLD builds about 10x faster.
_SEARCH_INTERVAL = 1e-3


def _secant(fn: Any, target: float, sigma: float, tol: float) -> float | None:
    """sigma with fn(sigma) = target by the secant method on (log sigma, log epsilon),
    where epsilon is close to a power of sigma; None when it does not converge."""
    xs = [math.log(sigma), math.log(sigma) + 0.02]
    fs = [math.log(max(fn(math.exp(x)), 1e-300)) - math.log(target) for x in xs]
    for _ in range(20):
        if not all(map(math.isfinite, fs)) or fs[-1] == fs[-2]:
            return None
        x = xs[-1] - fs[-1] * (xs[-1] - xs[-2]) / (fs[-1] - fs[-2])
        x = max(x, math.log(_SIGMA_MIN))
        if abs(x - xs[-1]) < tol:
            return math.exp(x)
        xs.append(x)
        fs.append(math.log(max(fn(math.exp(x)), 1e-300)) - math.log(target))
    return None


def _solve(searched: Any, target: float, method: AccountingMethod) -> float | None:
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
    """The smallest sigma >= 0.3 whose epsilon after `steps` steps is <= `target_epsilon`.

    PLD: the search runs on a 10x coarser pessimistic grid, whose epsilon lies just
    above the reported one (measured: the sigma found is within 0.2% of the reported
    accounting's own smallest sigma); the answer is then checked with the reported
    accounting (`epsilon`) and raised by 0.1% steps until it meets the target, so
    `epsilon(noise_multiplier_for(e, ...), ...) <= e` always holds. About 1-2 s where
    dp-accounting's calibration on the fine grid took 10-30 s.

    Raises:
        ValueError: an argument is out of range.
        PrivacyBudgetError: no sigma >= 0.3 reaches the target (below 0.3 the PLD
            discretisation grows without bound; such a target is no real privacy).
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon={target_epsilon} must be > 0")
    _validate(None, dataset_size, batch_size, steps, bands, delta)
    m = AccountingMethod(method)
    q = batch_size * bands / dataset_size
    count = math.ceil(steps / bands)

    def reported(sigma: float) -> float:
        return epsilon(sigma, dataset_size, batch_size, steps, bands, delta, m.value)

    def searched(sigma: float, interval: float = _SEARCH_INTERVAL) -> float:
        if m is AccountingMethod.PLD:
            return _OneRound(sigma, q, interval).epsilon(count, delta)
        return reported(sigma)

    def fail(why: str) -> PrivacyBudgetError:
        return PrivacyBudgetError(
            f"no noise_multiplier >= {_SIGMA_MIN} reaches epsilon={target_epsilon} at "
            f"delta={delta} for {steps} steps: {why}"
        )

    if searched(_SIGMA_MIN, 10 * _SEARCH_INTERVAL) <= target_epsilon:
        sigma = _SIGMA_MIN  # the floor: any target this loose is met at sigma = 0.3
    else:
        sigma = _solve(searched, target_epsilon, m)
        if sigma is None:  # the secant lost its way: bracket and bisect (slower, sure)
            lo, hi = _SIGMA_MIN, 1.0
            while searched(hi) > target_epsilon:
                lo, hi = hi, 2 * hi
                if hi > 1e6:
                    raise fail(f"epsilon still exceeds the target at sigma={lo:g}")
            x = optimize.brentq(
                lambda x: searched(math.exp(x)) - target_epsilon,
                math.log(lo),
                math.log(hi),
                xtol=1e-5,
            )
            sigma = math.exp(x)
        sigma *= 1 + 1e-5
    for _ in range(50):
        if reported(sigma) <= target_epsilon:
            return float(sigma)
        sigma *= 1.001
    raise fail(f"the search's answer {sigma:g} does not meet it under the reported accounting")


class Accountant:
    """Tracks the steps actually taken and reports the epsilon spent.

    Args:
        noise_multiplier, dataset_size, batch_size, bands, delta, method: as `epsilon`.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        dataset_size: int,
        batch_size: int,
        bands: int,
        delta: float,
        method: str = "pld",
    ) -> None:
        _validate(noise_multiplier, dataset_size, batch_size, 1, bands, delta)
        self.noise_multiplier = float(noise_multiplier)
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.bands = bands
        self.delta = float(delta)
        self.method = AccountingMethod(method)
        self.steps = 0

    def step(self, n: int = 1) -> None:
        """Record `n` more steps."""
        if n < 0:
            raise ValueError(f"step n={n} must be >= 0")
        self.steps += n

    def epsilon(self) -> float:
        """epsilon spent so far (0.0 before the first step)."""
        if self.steps == 0:
            return 0.0
        return epsilon(
            self.noise_multiplier,
            self.dataset_size,
            self.batch_size,
            self.steps,
            self.bands,
            self.delta,
            self.method.value,
        )

    def known_epsilon(self) -> float | None:
        """epsilon spent so far if it is already composed (by anyone in this process),
        else None; never composes. For displays that must not wait for a composition,
        which the checkpoint writer does off the training thread."""
        if self.steps == 0:
            return 0.0
        return _epsilon_known(
            self.noise_multiplier,
            self.dataset_size,
            self.batch_size,
            math.ceil(self.steps / self.bands),
            self.bands,
            self.delta,
            self.method,
        )

    def event(self) -> dict[str, Any] | None:
        """The composed dp-accounting event as a JSON-ready record."""
        if self.steps == 0:
            return None
        return {
            "type": "SelfComposedDpEvent",
            "count": math.ceil(self.steps / self.bands),
            "event": {
                "type": "PoissonSampledDpEvent",
                "sampling_probability": self.batch_size * self.bands / self.dataset_size,
                "event": {"type": "GaussianDpEvent", "noise_multiplier": self.noise_multiplier},
            },
        }

    def state_dict(self, *, with_epsilon: bool = True) -> dict[str, Any]:
        """The record; `with_epsilon=False` leaves `epsilon` None (it costs a PLD
        composition; the checkpoint writer fills it in off the training thread)."""
        return {
            "kind": "Accountant",
            "schema_version": 1,
            "method": self.method.value,
            "noise_multiplier": self.noise_multiplier,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "bands": self.bands,
            "delta": self.delta,
            "steps": self.steps,
            "event": self.event(),
            "epsilon": self.epsilon() if with_epsilon else None,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Accountant:
        """An accountant rebuilt from its record (steps included)."""
        check_state(state, "Accountant", 1)
        acc = cls(
            noise_multiplier=float(state["noise_multiplier"]),
            dataset_size=int(state["dataset_size"]),
            batch_size=int(state["batch_size"]),
            bands=int(state["bands"]),
            delta=float(state["delta"]),
            method=state["method"],
        )
        acc.steps = int(state["steps"])
        return acc

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count; refuses another mechanism's accountant."""
        check_state(state, "Accountant", 1)
        mine = (
            self.method.value,
            self.noise_multiplier,
            self.dataset_size,
            self.batch_size,
            self.bands,
            self.delta,
        )
        theirs = (
            state["method"],
            float(state["noise_multiplier"]),
            int(state["dataset_size"]),
            int(state["batch_size"]),
            int(state["bands"]),
            float(state["delta"]),
        )
        if mine != theirs:
            raise ValueError(
                f"accountant state is for (method, sigma, N, B, b, delta)={theirs}, this "
                f"accountant is {mine}"
            )
        self.steps = int(state["steps"])
