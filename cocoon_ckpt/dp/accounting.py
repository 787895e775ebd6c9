"""epsilon of amplified BandMF, composed with dp-accounting.

Under cyclic Poisson sampling over b partitions, b-banded MF with sensitivity-1 C is
accounted as a Poisson-subsampled Gaussian with q = B b / N, composed ceil(n / b)
times (Choquette-Choo et al., "Amplified Banded Matrix Factorization", 2023).
b = 1 is exactly DP-SGD's accounting. PLD epsilons come from the cached composition of
`cocoon_ckpt.dp.pld_composition`, and every epsilon is kept per process, keyed by the
round count.
"""

from __future__ import annotations

import enum
import math
import threading
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

from cocoon_ckpt.dp.pld_composition import PLD_INTERVAL, one_round, pld_epsilon

__all__ = [
    "AccountingMethod",
    "clear_caches",
    "dp_event",
    "epsilon",
    "epsilon_if_cached",
    "validate_arguments",
]


class AccountingMethod(enum.StrEnum):
    """Which dp-accounting accountant composes the events."""

    PLD = "pld"
    """Privacy loss distributions: tight."""
    RDP = "rdp"
    """Rényi DP: looser, faster."""


def validate_arguments(
    noise_multiplier: float | None,
    dataset_size: int,
    batch_size: int,
    steps: int,
    bands: int,
    delta: float,
) -> None:
    """Refuse arguments no accounting is defined for (as `epsilon`; noise_multiplier None
    skips its check, for calibration).

    Raises:
        ValueError: the message names the argument, its value and the rule.
    """
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
                eps = pld_epsilon(noise_multiplier, q, compositions, delta, PLD_INTERVAL)
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


def epsilon_if_cached(
    noise_multiplier: float,
    dataset_size: int,
    batch_size: int,
    compositions: int,
    bands: int,
    delta: float,
    method: AccountingMethod,
) -> float | None:
    """The epsilon of `compositions` rounds if this process has composed it already,
    else None; never composes (for displays that must not wait)."""
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
    validate_arguments(noise_multiplier, dataset_size, batch_size, steps, bands, delta)
    return _epsilon_cached(
        float(noise_multiplier),
        dataset_size,
        batch_size,
        math.ceil(steps / bands),
        bands,
        float(delta),
        AccountingMethod(method),
    )


def clear_caches() -> None:
    """Forget every cached epsilon and one-round PLD (a benchmark's cold start)."""
    with _epsilons_lock:
        _epsilons.clear()
    one_round.cache_clear()
