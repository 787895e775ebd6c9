"""epsilon of amplified BandMF, composed with dp-accounting.

Under cyclic Poisson sampling over b partitions, b-banded MF with sensitivity-1 C is
accounted as a Poisson-subsampled Gaussian with q = B b / N, composed ceil(n / b)
times (Choquette-Choo et al., "Amplified Banded Matrix Factorization", 2023).
b = 1 is exactly DP-SGD's accounting. PLD epsilons come from the cached composition of
`dp.accounting.pld_composition`, and every epsilon is kept per process, keyed by the
round count.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.accounting.pld_composition import PLD_INTERVAL, one_round, pld_epsilon
from cocoon_ckpt.errors import ConfigError, StoredStateError

__all__ = [
    "AccountingMethod",
    "clear_caches",
    "dp_event",
    "epsilon",
    "epsilon_of_event",
    "epsilon_of_run",
    "event_from_record",
    "validate_arguments",
]


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
        ConfigError: the message names the argument, its value and the rule.
    """
    if noise_multiplier is not None and not (
        noise_multiplier > 0 and math.isfinite(noise_multiplier)
    ):
        raise ConfigError(f"noise_multiplier={noise_multiplier} must be > 0")
    if not isinstance(dataset_size, int) or dataset_size < 1:
        raise ConfigError(f"dataset_size={dataset_size} must be an integer >= 1")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be an integer >= 1")
    if batch_size > dataset_size:
        raise ConfigError(f"batch_size={batch_size} exceeds dataset_size={dataset_size}")
    if not isinstance(bands, int) or bands < 1:
        raise ConfigError(f"bands={bands} must be an integer >= 1")
    if batch_size * bands > dataset_size:
        raise ConfigError(
            f"batch_size * bands = {batch_size * bands} exceeds dataset_size={dataset_size}: "
            "the sampling rate q = batch_size * bands / dataset_size would exceed 1"
        )
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps} must be an integer >= 1")
    if not 0 < delta < 1:
        raise ConfigError(f"delta={delta} must lie in (0, 1)")


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


def event_from_record(record: Mapping[str, Any]) -> dp_accounting.DpEvent:
    """The dp-accounting event a JSON record describes, as `Accountant.event` writes it:
    `SelfComposedDpEvent` (count, event), `PoissonSampledDpEvent` (sampling_probability,
    event) and `GaussianDpEvent` (noise_multiplier), nested.

    Raises:
        StoredStateError: the record, or an event inside it, is not one of these; the message
            names the part and what is wrong.
    """
    kind = record.get("type") if isinstance(record, Mapping) else None
    inner = record.get("event") if isinstance(record, Mapping) else None
    if kind == "GaussianDpEvent":
        sigma = record.get("noise_multiplier")
        if not (isinstance(sigma, (int, float)) and 0 < sigma < math.inf):
            raise StoredStateError(f"GaussianDpEvent noise_multiplier={sigma!r} must be > 0")
        return dp_accounting.GaussianDpEvent(float(sigma))
    if kind == "PoissonSampledDpEvent":
        q = record.get("sampling_probability")
        if not (isinstance(q, (int, float)) and 0 <= q <= 1):
            raise StoredStateError(
                f"PoissonSampledDpEvent sampling_probability={q!r} must lie in [0, 1]"
            )
        return dp_accounting.PoissonSampledDpEvent(float(q), event_from_record(inner or {}))
    if kind == "SelfComposedDpEvent":
        count = record.get("count")
        if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
            raise StoredStateError(f"SelfComposedDpEvent count={count!r} must be an integer >= 0")
        return dp_accounting.SelfComposedDpEvent(event_from_record(inner or {}), count)
    raise StoredStateError(
        f"accounting event {kind!r} is not one cocoon-ckpt records (SelfComposedDpEvent, "
        "PoissonSampledDpEvent, GaussianDpEvent)"
    )


def epsilon_of_event(record: Mapping[str, Any], delta: float, method: str = "pld") -> float:
    """epsilon at `delta` of a stored accounting event (the `event` of an accountant
    record), at any delta, not only the run's.

    The amplified-BandMF shape (k rounds of a Poisson-subsampled Gaussian) under PLD
    takes the cached composition (`pld_composition`), which is dp-accounting's own
    `PLDAccountant` result bit for bit; any other event, or RDP, is composed by
    dp-accounting directly.

    Raises:
        ValueError: `delta` is not in (0, 1), or the record is not an event
            (`event_from_record`).
    """
    if not 0 < delta < 1:
        raise ConfigError(f"delta={delta} must lie in (0, 1)")
    m = AccountingMethod(method)
    event = event_from_record(record)
    if isinstance(event, dp_accounting.GaussianDpEvent):
        # a BLT run's whole event: the Gaussian's exact profile, as its accountant
        # reports it (a PLD of it is a discretised upper bound)
        from cocoon_ckpt.dp.blt.accounting import blt_epsilon

        return blt_epsilon(event.noise_multiplier, 1.0, delta)
    if (
        m is AccountingMethod.PLD
        and isinstance(event, dp_accounting.SelfComposedDpEvent)
        and isinstance(event.event, dp_accounting.PoissonSampledDpEvent)
        and isinstance(event.event.event, dp_accounting.GaussianDpEvent)
        and event.count > 0
        and event.event.sampling_probability > 0
    ):
        sampled = event.event
        sigma = sampled.event.noise_multiplier
        return pld_epsilon(sigma, sampled.sampling_probability, event.count, delta, PLD_INTERVAL)
    acc = _accountant(m)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


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


def epsilon_of_run(
    dp: Mapping[str, Any], mechanism: Mapping[str, Any] | None, steps: int, method: str = "pld"
) -> float:
    """epsilon after `steps` steps of a stored run, under its mechanism's accounting:
    a BLT's (one Gaussian at its min-sep sensitivity, `dp.blt.accounting`) when the
    mechanism record is a BLT's, else amplified BandMF (`epsilon`). What readers of a
    store (audit, export) recompute and compare with the accountant's record.

    Args:
        dp: the `dp` mapping of a config record (sigma calibrated or given).
        mechanism: the version's `mechanism` record (None: BandMF, older stores).
        steps: steps taken (>= 1).
        method: the accountant's method (a BLT's epsilon is exact under either).

    Raises:
        ValueError: an argument or the BLT record is out of range.
        KeyError, TypeError: a record lacks a field or has the wrong type.
    """
    sigma, bands, delta = float(dp["noise_multiplier"]), int(dp["bands"]), float(dp["delta"])
    if mechanism is not None and mechanism.get("kind") == "BLT":
        from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity, blt_epsilon
        from cocoon_ckpt.dp.blt.strategy import BLT

        blt = BLT.from_state_dict(dict(mechanism))
        sens = accounting_sensitivity(blt, int(dp["steps"]), bands)
        return blt_epsilon(sigma, sens, delta)
    return epsilon(
        sigma, int(dp["dataset_size"]), int(dp["batch_size"]), steps, bands, delta, method
    )


def clear_caches() -> None:
    """Forget every cached epsilon and one-round PLD (a benchmark's cold start)."""
    with _epsilons_lock:
        _epsilons.clear()
    one_round.cache_clear()
