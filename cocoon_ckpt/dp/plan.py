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

The numbers compare rows of one plan (same N, B, n, delta); they are not accuracies.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import TypedDict

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.dp.accountant import AccountingMethod, noise_multiplier_for
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind

__all__ = ["DEFAULT_BANDS", "MECHANISMS", "Plan", "PlanRow", "candidate_bands", "plan"]

#: Candidate band counts when the caller names none (those the data and steps allow).
DEFAULT_BANDS = (1, 2, 4, 8, 16, 32, 64)
#: The mechanisms a plan can weigh (CUSTOM has no coefficients to weigh).
MECHANISMS = (MechanismKind.BANDED_SQRT, MechanismKind.OPTIMIZED, MechanismKind.OPTIMIZED_COLNORM)
# The default rows; optimized_colnorm (it beats optimized in every row) by name only, as
# the trainer cannot build it yet.
_DEFAULT_MECHANISMS = (MechanismKind.BANDED_SQRT, MechanismKind.OPTIMIZED)
#: Bytes per noise value: the ring holds float32.
_FLOAT_BYTES = 4


class PlanRowRecord(TypedDict):
    """`PlanRow.to_record()`."""

    bands: int
    mechanism: str | None
    noise_multiplier: float
    sampling_rate: float
    rounds: int
    predicted_error: float
    relative_error: float
    state_bytes_per_param: int
    state_bytes: int | None
    step_read_bytes: int | None


class PlanRecord(TypedDict):
    """`Plan.to_record()`."""

    kind: str
    schema_version: int
    target_epsilon: float
    delta: float
    dataset_size: int
    batch_size: int
    steps: int
    method: str
    model_params: int | None
    rows: list[PlanRowRecord]
    recommended: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanRow:
    """One candidate configuration and what it is predicted to cost."""

    bands: int
    """b (1 = DP-SGD)."""
    mechanism: MechanismKind | None
    """How C's bands are chosen; None for b = 1, where every mechanism is DP-SGD."""
    noise_multiplier: float
    """sigma that reaches the plan's target epsilon at this b's sampling rate."""
    sampling_rate: float
    """q = B b / N, each example's chance of being in a batch of its partition."""
    rounds: int
    """ceil(n / b): how many times each example can take part (composed rounds)."""
    predicted_error: float
    """sigma^2 ||A C^-1||_F^2 / n: mean per-coordinate variance of the summed noise, in
    units of clip^2 (see the module docstring)."""
    relative_error: float
    """predicted_error / the DP-SGD row's: below 1 is less noise than DP-SGD."""
    state_bytes_per_param: int
    """Noise history per model parameter: (b - 1) float32 values."""
    state_bytes: int | None
    """Noise history of the whole model (None when the plan has no model size)."""
    step_read_bytes: int | None
    """Bytes the history GEMV reads per step, (b - 1) x 4 x parameters (None as above)."""

    @property
    def label(self) -> str:
        """ "dp-sgd" for b = 1, else the mechanism's name."""
        return "dp-sgd" if self.mechanism is None else self.mechanism.value

    def to_record(self) -> PlanRowRecord:
        return {
            "bands": self.bands,
            "mechanism": None if self.mechanism is None else self.mechanism.value,
            "noise_multiplier": self.noise_multiplier,
            "sampling_rate": self.sampling_rate,
            "rounds": self.rounds,
            "predicted_error": self.predicted_error,
            "relative_error": self.relative_error,
            "state_bytes_per_param": self.state_bytes_per_param,
            "state_bytes": self.state_bytes,
            "step_read_bytes": self.step_read_bytes,
        }

    @classmethod
    def from_record(cls, record: PlanRowRecord) -> PlanRow:
        mech = record["mechanism"]
        return cls(
            bands=int(record["bands"]),
            mechanism=None if mech is None else MechanismKind(mech),
            noise_multiplier=float(record["noise_multiplier"]),
            sampling_rate=float(record["sampling_rate"]),
            rounds=int(record["rounds"]),
            predicted_error=float(record["predicted_error"]),
            relative_error=float(record["relative_error"]),
            state_bytes_per_param=int(record["state_bytes_per_param"]),
            state_bytes=record["state_bytes"],
            step_read_bytes=record["step_read_bytes"],
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every candidate row of one setting, sorted by b then mechanism, and the pick."""

    target_epsilon: float
    """epsilon every row reaches after `steps` steps."""
    delta: float
    """delta of that epsilon."""
    dataset_size: int
    """N examples."""
    batch_size: int
    """B, the expected batch size (the same for every b)."""
    steps: int
    """n training steps."""
    method: AccountingMethod
    """Accounting that calibrated sigma."""
    model_params: int | None
    """Parameters of the model, for the byte totals (None: per-parameter figures only)."""
    rows: tuple[PlanRow, ...]
    """One per (b, mechanism); one row for b = 1 (DP-SGD), always present."""
    recommended: int
    """Index into `rows` of the smallest predicted error (see `plan` for what that
    ignores); ties go to fewer bands."""

    @property
    def recommendation(self) -> PlanRow:
        """The recommended row."""
        return self.rows[self.recommended]

    def to_record(self) -> PlanRecord:
        return {
            "kind": "Plan",
            "schema_version": 1,
            "target_epsilon": self.target_epsilon,
            "delta": self.delta,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "method": self.method.value,
            "model_params": self.model_params,
            "rows": [row.to_record() for row in self.rows],
            "recommended": self.recommended,
        }

    @classmethod
    def from_record(cls, record: PlanRecord) -> Plan:
        if (record.get("kind"), record.get("schema_version")) != ("Plan", 1):
            raise ValueError(
                f"record is kind={record.get('kind')!r} schema_version="
                f"{record.get('schema_version')!r}, expected a Plan of schema_version 1"
            )
        return cls(
            target_epsilon=float(record["target_epsilon"]),
            delta=float(record["delta"]),
            dataset_size=int(record["dataset_size"]),
            batch_size=int(record["batch_size"]),
            steps=int(record["steps"]),
            method=AccountingMethod(record["method"]),
            model_params=record["model_params"],
            rows=tuple(PlanRow.from_record(r) for r in record["rows"]),
            recommended=int(record["recommended"]),
        )

    def to_json(self) -> str:
        """The record as JSON (floats round-trip exactly)."""
        return json.dumps(self.to_record(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        record: PlanRecord = json.loads(text)
        return cls.from_record(record)

    def render(self) -> str:
        """A text table, one line per row, the recommended one marked with `*`."""
        params = "" if self.model_params is None else f", {self.model_params:,} parameters"
        lines = [
            f"epsilon={self.target_epsilon:g} delta={self.delta:g} dataset={self.dataset_size}"
            f" batch={self.batch_size} steps={self.steps} ({self.method.value}{params})",
            f"  {'b':>4}  {'mechanism':<12}{'sigma':>8}{'q':>9}{'rounds':>8}"
            f"{'pred. error':>13}{'vs DP-SGD':>11}{'state/param':>13}{'state':>11}"
            f"{'GEMV/step':>11}",
        ]
        for i, row in enumerate(self.rows):
            mark = "*" if i == self.recommended else " "
            lines.append(
                f"{mark} {row.bands:>4}  {row.label:<12}{row.noise_multiplier:>8.4f}"
                f"{row.sampling_rate:>9.4f}{row.rounds:>8}{row.predicted_error:>13.5g}"
                f"{row.relative_error:>11.3f}{row.state_bytes_per_param:>11} B"
                f"{_bytes(row.state_bytes):>11}{_bytes(row.step_read_bytes):>11}"
            )
        best = self.recommendation
        lines.append(
            f"recommended: bands={best.bands} mechanism={best.label}: predicted error "
            f"{best.relative_error:.3f}x DP-SGD's at sigma={best.noise_multiplier:.4f} "
            "(the noise model only: see `plan` for what it ignores)"
        )
        return "\n".join(lines)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    power = min(int(math.log(n, 1024)), 3) if n else 0
    return f"{n / 1024**power:.4g} {('B', 'KiB', 'MiB', 'GiB')[power]}"


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
            banded_sqrt and optimized.
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
        total = None if model_params is None else (b - 1) * _FLOAT_BYTES * model_params
        for kind in [None] if b == 1 else kinds:
            error = error_of(kind or MechanismKind.BANDED_SQRT, b)
            rows.append(
                PlanRow(
                    bands=b,
                    mechanism=kind,
                    noise_multiplier=sigma_at(b),
                    sampling_rate=batch_size * b / dataset_size,
                    rounds=math.ceil(steps / b),
                    predicted_error=error,
                    relative_error=error / baseline,
                    state_bytes_per_param=(b - 1) * _FLOAT_BYTES,
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
