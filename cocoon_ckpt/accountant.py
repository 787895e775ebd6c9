"""Privacy accounting for amplified BandMF, composed with dp-accounting.

Under cyclic Poisson sampling over b partitions, b-banded MF with sensitivity-1 C is
accounted as a Poisson-subsampled Gaussian with q = B b / N, composed ceil(n / b)
times (Choquette-Choo et al., "Amplified Banded Matrix Factorization", 2023).
b = 1 is exactly DP-SGD's accounting.
"""

from __future__ import annotations

import enum
import functools
import math
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

from ._state_dict import check_state
from .errors import PrivacyBudgetError

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


@functools.lru_cache(maxsize=4096)
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
    acc = _accountant(method)
    acc.compose(dp_event(noise_multiplier, dataset_size, batch_size, compositions * bands, bands))
    return float(acc.get_epsilon(delta))


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

    Raises:
        ValueError: an argument is out of range.
        PrivacyBudgetError: no sigma >= 0.3 reaches the target (below 0.3 the PLD
            discretisation grows without bound; such a target is no real privacy).
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon={target_epsilon} must be > 0")
    _validate(None, dataset_size, batch_size, steps, bands, delta)
    m = AccountingMethod(method)
    if (
        epsilon(_SIGMA_MIN, dataset_size, batch_size, steps, bands, delta, m.value)
        <= target_epsilon
    ):
        return _SIGMA_MIN  # the floor: any target this loose is met at sigma = 0.3
    try:
        return float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: _accountant(m),
                lambda s: dp_event(s, dataset_size, batch_size, steps, bands),
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(_SIGMA_MIN, 1.0),
                tol=1e-4,
            )
        )
    except (ValueError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError) as exc:
        raise PrivacyBudgetError(
            f"no noise_multiplier >= {_SIGMA_MIN} reaches epsilon={target_epsilon} at "
            f"delta={delta} for {steps} steps: {exc}"
        ) from exc


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
