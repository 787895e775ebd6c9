"""A job for the exit-code tests: the mlp example with one thing wrong where the
environment variable `FAMILY_FAULT` says (the environment, not `--job-option`, so the
recorded config stays the same between runs): "not_parts" a builder that returns a
model instead of `JobParts` (a malformed request), "stateful" a stateful part under
another name than the store's (a refusal by the store's state), "nan" inputs that are
all NaN (a run that fails at its first step).

`python -m cocoon_ckpt train --job tests._cli.family_jobs:build` runs it from the
repository root.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import TensorDataset

from cocoon_ckpt import JobConfig
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts

__all__ = ["Counter", "build"]


class Counter:
    """A stateful part with one number in its state."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])


def build(config: JobConfig) -> JobParts:
    """The mlp example's parts and a `Counter`, broken as `FAMILY_FAULT` says."""
    parts = mlp.build(config)
    fault = os.environ.get("FAMILY_FAULT", "")
    if fault == "not_parts":
        return parts.model  # type: ignore[return-value]
    x, y = parts.dataset  # type: ignore[misc]
    if fault == "nan":
        x = torch.full_like(x, float("nan"))
    name = "renamed" if fault == "stateful" else "counter"
    return JobParts(
        model=parts.model,
        optimizer=parts.optimizer,
        loss_fn=parts.loss_fn,
        dataset=TensorDataset(x, y),
        stateful={name: Counter()},
    )
