"""A plan's rows and the plan itself as values: records, JSON, the text table.

`cocoon_ckpt.dp.plan` computes them; this module only holds and shows them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TypedDict

from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.mechanism import MechanismKind

__all__ = ["Plan", "PlanRecord", "PlanRow", "PlanRowRecord"]


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
    """How C's bands are chosen (or `blt`); None for b = 1, where every mechanism is
    DP-SGD."""
    noise_multiplier: float
    """sigma that reaches the plan's target epsilon at this b's sampling rate (a BLT's:
    without amplification, at its min-sep sensitivity)."""
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
    """Noise history per model parameter: (b - 1) float32 values (a BLT's: d)."""
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
