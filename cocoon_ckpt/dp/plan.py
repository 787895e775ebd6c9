"""Choosing b and the mechanism before a job runs: the predicted privacy/utility trade.

For each candidate band count b and mechanism, `plan` calibrates sigma to the target
epsilon under that b's sampling (cyclic Poisson: q = B b / N, ceil(n / b) rounds) and
predicts the error of the noise the job would add: the prefix-sum workload loss
||A C^-1||_F^2 of the mechanism (C at sensitivity 1) times sigma^2, divided by n. That
is the mean over steps t of the per-coordinate variance of the summed noise
sum_{s<=t} w_s, in units of the clipping norm squared: what plain SGD with a constant
learning rate accumulates into its parameters. b = 1 is DP-SGD, where it is
sigma^2 (n + 1) / 2. More bands cancel more of the past noise but sample each example
more often (q grows with b), so sigma grows with b too; which wins depends on epsilon.

A BLT row (`mechanism="blt"`, by name only) is weighed under its own accounting: b is
its min-sep, sigma meets the target as one Gaussian at sigma / sens without
amplification (`dp.blt.accounting`), and its error is sigma^2 ||A C^-1||_F^2 / n, the
min-sep loss at that Gaussian's noise multiplier; its state is d buffers, not b - 1.

The numbers compare rows of one plan (same N, B, n, delta); they are not accuracies.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.dp.accounting.calibration import blt_noise_multiplier, noise_multiplier_for
from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.plan_rows import Plan, PlanRow

__all__ = ["DEFAULT_BANDS", "MECHANISMS", "Plan", "PlanRow", "candidate_bands", "plan"]

#: Candidate band counts when the caller names none (those the data and steps allow).
DEFAULT_BANDS = (1, 2, 4, 8, 16, 32, 64)
#: The mechanisms a plan can weigh (CUSTOM has no coefficients to weigh).
MECHANISMS = (
    MechanismKind.BANDED_SQRT,
    MechanismKind.OPTIMIZED,
    MechanismKind.OPTIMIZED_COLNORM,
    MechanismKind.BLT,
)
# The default rows; optimized_colnorm (it beats optimized in every row) by name only, as
# the trainer cannot build it yet.
_DEFAULT_MECHANISMS = (MechanismKind.BANDED_SQRT, MechanismKind.OPTIMIZED)
#: Bytes per noise value: the ring holds float32.
_FLOAT_BYTES = 4


@functools.lru_cache(maxsize=64)
def _mechanism(kind: MechanismKind, bands: int, steps: int) -> BandMF:
    # The optimized strategy runs L-BFGS (measured: 0.04-0.4 s per b at n = 1500); a
    # plan asks once per b and the CLI may ask again for the chosen row.
    if kind is MechanismKind.OPTIMIZED:
        return BandMF.optimized(bands, steps)
    if kind is MechanismKind.OPTIMIZED_COLNORM:
        return BandMF.column_normalize(_mechanism(MechanismKind.OPTIMIZED, bands, steps))
    return BandMF.banded_sqrt(bands, steps)


#: noise_multiplier_for, remembered: each calibration composes PLDs for 1-10 s, and plans
#: at one setting (the CLI's, a bench's epsilon grid) ask for the same ones again.
_sigma = functools.lru_cache(maxsize=256)(noise_multiplier_for)


@functools.lru_cache(maxsize=64)
def _blt_row(
    target_epsilon: float, delta: float, bands: int, steps: int
) -> tuple[float, float, int]:
    """(sigma, predicted error, buffers) of the BLT fitted for (steps, bands), under
    its own accounting (the module docstring)."""
    from cocoon_ckpt.dp.blt.optimize import job_blt  # torch: only when a BLT is weighed

    blt = job_blt(steps, bands)
    sens = accounting_sensitivity(blt, steps, bands)
    sigma = blt_noise_multiplier(target_epsilon, sens, delta)
    return sigma, (sigma / sens) ** 2 * blt.minsep_loss(bands) / steps, blt.buffers


def _check(
    target_epsilon: float,
    delta: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    model_params: int | None,
) -> None:
    valid.positive_real("target_epsilon", target_epsilon)
    valid.real_between("delta", delta, 0.0, 1.0)
    valid.integer("dataset_size", dataset_size, 1, valid.MAX_COUNT)
    valid.integer("batch_size", batch_size, 1, dataset_size)
    valid.integer("steps", steps, 1, valid.MAX_STEPS)
    if model_params is not None:
        valid.integer("model_params", model_params, 1, valid.MAX_COUNT)


def candidate_bands(*, dataset_size: int, batch_size: int, steps: int) -> tuple[int, ...]:
    """`DEFAULT_BANDS` less those the setting cannot run: b partitions need B b <= N,
    and a band longer than the run has no effect (b <= n)."""
    return tuple(b for b in DEFAULT_BANDS if b <= steps and b * batch_size <= dataset_size)


def _chosen_bands(
    bands: Sequence[int] | None, dataset_size: int, batch_size: int, steps: int
) -> list[int]:
    if bands is None:
        chosen = list(
            candidate_bands(dataset_size=dataset_size, batch_size=batch_size, steps=steps)
        )
    else:
        valid.check(len(bands) > 0, "bands", bands, "name at least one band count")
        for b in bands:
            valid.integer("bands", b, 1, steps)
            valid.check(
                b * batch_size <= dataset_size,
                "bands",
                b,
                f"satisfy batch_size * bands <= dataset_size={dataset_size} (batch_size="
                f"{batch_size}: the data is split into b partitions of N / b examples)",
            )
        chosen = list(bands)
    # DP-SGD is always a row: every other row's relative error is against it.
    return sorted({1, *chosen})


def _mechanisms(mechanisms: Sequence[MechanismKind | str]) -> list[MechanismKind]:
    valid.check(len(mechanisms) > 0, "mechanisms", mechanisms, "name at least one mechanism")
    names = tuple(m.value for m in MECHANISMS)
    for m in mechanisms:
        valid.text("mechanisms", m, names)
    return sorted({MechanismKind(m) for m in mechanisms}, key=MECHANISMS.index)


def plan(
    *,
    target_epsilon: float,
    delta: float,
    dataset_size: int,
    batch_size: int,
    steps: int,
    bands: Sequence[int] | None = None,
    mechanisms: Sequence[MechanismKind | str] = _DEFAULT_MECHANISMS,
    method: AccountingMethod | str = AccountingMethod.PLD,
    model_params: int | None = None,
) -> Plan:
    """Calibrate sigma and predict the noise error of each (b, mechanism) at one setting.

    The recommendation is the row of smallest predicted error. It weighs the summed
    noise of plain SGD with a constant learning rate and nothing else: not the size of
    each step's own noise C^-1 z (at the digits setting its std is 1.5-10x DP-SGD's
    for b > 1, which a nonlinear model may feel where the sums cancel), not Adam or a
    learning-rate schedule, not clipping bias, not the spread between seeds (a few
    percent of predicted error is below what a trained model shows), and not memory or
    time (the rows report the noise-state bytes and the GEMV reads; weigh them).

    Args:
        target_epsilon: epsilon every row must reach after `steps` steps (> 0).
        delta: delta in (0, 1).
        dataset_size: N examples.
        batch_size: B, expected batch size (<= N).
        steps: n training steps.
        bands: candidate b values (each in [1, steps] with B b <= N); None takes
            `candidate_bands(...)`. b = 1 (DP-SGD) is always added.
        mechanisms: any of `MECHANISMS` (MechanismKind or its value); by default
            banded_sqrt and optimized (`blt` fits a BLT per b: seconds each).
        method: accounting that calibrates sigma ("pld" tight, "rdp" looser).
        model_params: parameters of the model, for byte totals; None leaves them out.

    Returns:
        The plan: rows sorted by b then mechanism, and the recommended row's index.

    Raises:
        ConfigError: an argument is out of range; the message names it.
        PrivacyBudgetError: no sigma >= 0.3 reaches the target at some b.
    """
    _check(target_epsilon, delta, dataset_size, batch_size, steps, model_params)
    candidates = _chosen_bands(bands, dataset_size, batch_size, steps)
    kinds = _mechanisms(mechanisms)
    valid.text("method", method, tuple(m.value for m in AccountingMethod))
    accounting = AccountingMethod(method)

    def sigma_at(b: int) -> float:
        args = (float(target_epsilon), dataset_size, batch_size, steps, b, float(delta))
        return _sigma(*args, accounting.value)

    def error_of(kind: MechanismKind, b: int) -> float:
        # loss() is ||A C^-1||_F^2 times C's squared sensitivity, which is what the
        # accountant's sigma multiplies: rows of any normalisation compare.
        return sigma_at(b) ** 2 * _mechanism(kind, b, steps).loss() / steps

    baseline = error_of(MechanismKind.BANDED_SQRT, 1)  # C = [1]: DP-SGD
    rows: list[PlanRow] = []
    for b in candidates:
        for kind in [None] if b == 1 else kinds:
            if kind is MechanismKind.BLT:
                sigma, error, slots = _blt_row(float(target_epsilon), float(delta), b, steps)
            else:
                sigma = sigma_at(b)
                error, slots = error_of(kind or MechanismKind.BANDED_SQRT, b), b - 1
            total = None if model_params is None else slots * _FLOAT_BYTES * model_params
            rows.append(
                PlanRow(
                    bands=b,
                    mechanism=kind,
                    noise_multiplier=sigma,
                    sampling_rate=batch_size * b / dataset_size,
                    rounds=math.ceil(steps / b),
                    predicted_error=error,
                    relative_error=error / baseline,
                    state_bytes_per_param=slots * _FLOAT_BYTES,
                    # The GEMV reads the whole history each step: the bytes it holds.
                    state_bytes=total,
                    step_read_bytes=total,
                )
            )
    best = min(range(len(rows)), key=lambda i: (rows[i].predicted_error, rows[i].bands))
    return Plan(
        target_epsilon=float(target_epsilon),
        delta=float(delta),
        dataset_size=dataset_size,
        batch_size=batch_size,
        steps=steps,
        method=accounting,
        model_params=model_params,
        rows=tuple(rows),
        recommended=best,
    )
