"""BandMF: the banded lower-triangular Toeplitz strategy matrix C.

C[t, t-j] = c_j for 0 <= j < b, scaled so that C's largest column norm is 1 (the
sensitivity under b-min-separated participation). Noise w = C^-1 z is added to the
gradients; the error of the prefix-sum workload A (lower-triangular ones) is
||A C^-1||_F^2 times the squared sensitivity.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np

from cocoon_ckpt._state_dict import check_state

__all__ = ["BandMF", "MechanismKind"]


class MechanismKind(enum.StrEnum):
    """How the band coefficients were chosen (a privacy-neutral, utility choice)."""

    BANDED_SQRT = "banded_sqrt"
    """Closed form: the first b coefficients of the square root of A, binom(2j, j)/4^j."""
    OPTIMIZED = "optimized"
    """Minimised prefix-sum error under the column-norm constraint."""
    CUSTOM = "custom"
    """Coefficients supplied by the caller."""


def _validate(bands: int, steps: int) -> None:
    if not isinstance(bands, int) or bands < 1:
        raise ValueError(f"Expected bands={bands!r} >= 1 (bands=1 is DP-SGD)")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"Expected steps={steps!r} >= 1")
    if bands > steps:
        raise ValueError(
            f"bands={bands} exceeds steps={steps}: a band longer than the run has no effect; "
            f"use bands <= {steps}"
        )


def _inverse_first_column(c: np.ndarray, n: int) -> np.ndarray:
    """First column d of C^-1 (C^-1 is lower-triangular Toeplitz too), length n."""
    b = len(c)
    d = np.zeros(n)
    d[0] = 1.0 / c[0]
    for k in range(1, n):
        j = min(k, b - 1)
        d[k] = -np.dot(c[1 : j + 1], d[k - 1 :: -1][:j]) / c[0]
    return d


class BandMF:
    """A b-banded matrix-factorization mechanism for `steps` steps.

    Use `BandMF.banded_sqrt(bands, steps)` or `BandMF.optimized(bands, steps)`.

    Args:
        coefficients: c_0..c_{b-1}, any positive scale (normalised here).
        steps: n, the number of steps the mechanism serves.
        kind: how the coefficients were chosen.
    """

    def __init__(
        self, coefficients: np.ndarray, *, steps: int, kind: MechanismKind = MechanismKind.CUSTOM
    ) -> None:
        c = np.asarray(coefficients, dtype=np.float64).copy()
        if c.ndim != 1 or len(c) < 1:
            raise ValueError(f"coefficients must be a non-empty vector, got shape {c.shape}")
        _validate(len(c), steps)
        if not np.all(np.isfinite(c)) or c[0] <= 0:
            raise ValueError(f"coefficients must be finite with c_0 > 0, got c_0={c[0]}")
        self._c = c / np.linalg.norm(c)  # column 0 holds every band: the largest norm
        self._c.setflags(write=False)
        self.steps = steps
        self.kind = MechanismKind(kind)

    # constructors ----------------------------------------------------------------
    @classmethod
    def banded_sqrt(cls, bands: int, steps: int) -> BandMF:
        """Closed form: c_j = binom(2j, j) / 4^j (the square root of A, banded)."""
        _validate(bands, steps)
        c = np.array([math.comb(2 * j, j) / 4.0**j for j in range(bands)])
        return cls(c, steps=steps, kind=MechanismKind.BANDED_SQRT)

    @classmethod
    def optimized(cls, bands: int, steps: int, *, max_iter: int = 500) -> BandMF:
        """Minimise ||A C^-1||_F^2 over c (max column norm 1) for the prefix-sum A.

        Starts from the banded square root and runs L-BFGS with torch autograd, so the
        result is never worse than `banded_sqrt` on `loss()`.
        """
        # torch and scipy load here, not at import: `cocoon-ckpt inspect` and other
        # store-only commands never need them and start in a fraction of the time.
        import torch
        from scipy.optimize import minimize

        start = cls.banded_sqrt(bands, steps)
        if bands == 1:
            return cls(start.coefficients, steps=steps, kind=MechanismKind.OPTIMIZED)
        n = steps
        rows = torch.arange(n).unsqueeze(1)
        lag = rows - torch.arange(n).unsqueeze(0)
        band_mask = (lag >= 0) & (lag < bands)
        lag_idx = lag.clamp(0, bands - 1)
        weights = torch.arange(n, 0, -1, dtype=torch.float64)  # (n - k)
        e0 = torch.zeros(n, 1, dtype=torch.float64)
        e0[0] = 1.0

        def loss_and_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
            tail = torch.tensor(x, dtype=torch.float64, requires_grad=True)
            c = torch.cat([torch.ones(1, dtype=torch.float64), tail])
            cmat = torch.where(band_mask, c[lag_idx], torch.zeros((), dtype=torch.float64))
            d = torch.linalg.solve_triangular(cmat, e0, upper=False).squeeze(1)
            e = torch.cumsum(d, 0)
            loss = (weights * e * e).sum() * (c * c).sum()
            (grad,) = torch.autograd.grad(loss, tail)
            return float(loss.detach()), grad.numpy().copy()

        c0 = start.coefficients / start.coefficients[0]
        res = minimize(
            loss_and_grad, c0[1:], jac=True, method="L-BFGS-B", options={"maxiter": max_iter}
        )
        best = np.concatenate([[1.0], res.x])
        if cls(best, steps=steps).loss() > start.loss():
            best = start.coefficients
        return cls(best, steps=steps, kind=MechanismKind.OPTIMIZED)

    # properties ------------------------------------------------------------------
    @property
    def coefficients(self) -> np.ndarray:
        """c_0..c_{b-1}, float64, scaled so C's largest column norm is 1."""
        return self._c

    @property
    def bands(self) -> int:
        return len(self._c)

    @property
    def sensitivity(self) -> float:
        """Largest column norm of C (1 by construction)."""
        return float(np.linalg.norm(self._c))

    def matrix(self, n: int | None = None) -> np.ndarray:
        """Dense C, (n, n) float64 (n defaults to `steps`). For tests and audit."""
        n = self.steps if n is None else n
        out = np.zeros((n, n))
        for j, cj in enumerate(self._c[:n]):
            idx = np.arange(j, n)
            out[idx, idx - j] = cj
        return out

    def loss(self, n: int | None = None) -> float:
        """Prefix-sum workload error ||A C^-1||_F^2 with C at sensitivity 1.

        DP-SGD (b=1) gives n(n+1)/2; comparable across mechanisms of the same n.
        """
        n = self.steps if n is None else n
        d = _inverse_first_column(self._c, n)
        e = np.cumsum(d)
        w = np.arange(n, 0, -1, dtype=np.float64)
        col = float(np.sum(self._c[:n] ** 2))
        return float(np.sum(w * e * e) * col)

    def mixing_vector(self, t: int) -> np.ndarray:
        """Weights over ring slots for step t: slot (t-j) mod (b-1) gets c_j, j=1..b-1.

        Slots holding steps before 0 (t < j) get weight 0. Shape (b-1,) float64.
        """
        b = self.bands
        out = np.zeros(max(b - 1, 0))
        for j in range(1, min(t, b - 1) + 1):
            out[(t - j) % (b - 1)] = self._c[j]
        return out

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "BandMF",
            "schema_version": 1,
            "mechanism": self.kind.value,
            "steps": self.steps,
            "coefficients": [float(x) for x in self._c],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BandMF:
        check_state(state, "BandMF", 1)
        m = cls(
            np.array(state["coefficients"]),
            steps=int(state["steps"]),
            kind=MechanismKind(state["mechanism"]),
        )
        # Keep the stored values bit for bit: normalising twice can move the last ulp.
        m._c = np.array(state["coefficients"], dtype=np.float64)
        m._c.setflags(write=False)
        return m

    def __repr__(self) -> str:
        return f"BandMF({self.kind.value}, bands={self.bands}, steps={self.steps})"
