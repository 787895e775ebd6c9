"""The privacy accountant of a run: the steps taken, the epsilon spent, its record."""

from __future__ import annotations

import math
from typing import Any

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.accounting.amplified import epsilon, validate_arguments
from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.blt.accounting import blt_dp_event, blt_epsilon
from cocoon_ckpt.errors import ConfigError, StoredStateError

__all__ = ["Accountant"]


class Accountant:
    """Tracks the steps actually taken and reports the epsilon spent.

    Two accountings, chosen by the mechanism: amplified BandMF (ceil(t / b) rounds of a
    Poisson-subsampled Gaussian, `dp.accounting`), or, for a BLT (`sensitivity` given),
    the whole run as one Gaussian at sigma / sensitivity without amplification
    (`dp.blt.accounting`): its epsilon is exact at the end and an upper bound at every
    step before, and it is the Gaussian's exact profile whatever `method` says.

    Args:
        noise_multiplier: sigma, as `epsilon`.
        dataset_size: N, as `epsilon`.
        batch_size: B, as `epsilon`.
        bands: b, as `epsilon`.
        delta: the delta epsilon is reported at, as `epsilon`.
        method: the accounting (`pld` or `rdp`), as `epsilon`.
        sensitivity: a BLT's min-sep sensitivity (`blt.accounting.accounting_sensitivity`);
            None for BandMF.
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
        sensitivity: float | None = None,
    ) -> None:
        validate_arguments(noise_multiplier, dataset_size, batch_size, 1, bands, delta)
        if sensitivity is not None and not (sensitivity > 0 and math.isfinite(sensitivity)):
            raise ConfigError(f"Accountant sensitivity={sensitivity} must be > 0 and finite")
        self.sensitivity = None if sensitivity is None else float(sensitivity)
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
            raise ConfigError(f"step n={n} must be >= 0")
        self.steps += n

    def epsilon(self) -> float:
        """epsilon spent so far (0.0 before the first step)."""
        if self.steps == 0:
            return 0.0
        if self.sensitivity is not None:
            return blt_epsilon(self.noise_multiplier, self.sensitivity, self.delta)
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
        if self.sensitivity is not None:
            event = blt_dp_event(self.noise_multiplier, self.sensitivity)
            return {"type": "GaussianDpEvent", "noise_multiplier": event.noise_multiplier}
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
        composition; the checkpoint writer fills it in, off the training thread, for
        the job's last version only: readers compose a mid-run version's). A BLT's
        accountant adds `sensitivity` (BandMF records are as they always were)."""
        out: dict[str, Any] = {
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
        if self.sensitivity is not None:
            out["sensitivity"] = self.sensitivity
        return out

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
            sensitivity=_sensitivity(state),
        )
        acc.steps = int(state["steps"])
        return acc

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the step count; refuses another mechanism's accountant. The method is
        not compared: it changes the reported epsilon, not the noise, so this accountant
        reports the steps restored under its own."""
        check_state(state, "Accountant", 1)
        mine = (
            self.noise_multiplier,
            self.dataset_size,
            self.batch_size,
            self.bands,
            self.delta,
        )
        theirs = (
            float(state["noise_multiplier"]),
            int(state["dataset_size"]),
            int(state["batch_size"]),
            int(state["bands"]),
            float(state["delta"]),
        )
        if mine != theirs or self.sensitivity != _sensitivity(state):
            raise StoredStateError(
                f"accountant state is for (sigma, N, B, b, delta)={theirs} at sensitivity "
                f"{_sensitivity(state)}, this accountant is {mine} at {self.sensitivity}"
            )
        self.steps = int(state["steps"])


def _sensitivity(state: dict[str, Any]) -> float | None:
    """A record's BLT sensitivity (absent: BandMF's accounting)."""
    value = state.get("sensitivity")
    return None if value is None else float(value)
