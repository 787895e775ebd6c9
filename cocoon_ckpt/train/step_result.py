"""What one DP step did: its index, loss and batch, and signal against noise."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepResult"]


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one DP step did.

    Attributes:
        step: The step index t just taken (0-based).
        loss: Mean loss over the sampled batch (nan for an empty batch).
        batch_size: How many examples were sampled.
        grad_norm: L2 norm of the clipped per-sample gradient sum, before noise (dense parameters).
        noise_norm: L2 norm of the correlated noise w_t added to that sum.
    """

    step: int
    loss: float
    batch_size: int
    grad_norm: float = float("nan")
    noise_norm: float = float("nan")
