"""BandMF: the banded lower-triangular Toeplitz strategy matrix C.

C[t, t-j] = c_j for 0 <= j < b, scaled so that C's largest column norm is 1 (the
sensitivity under b-min-separated participation). Noise w = C^-1 z is added to the
gradients; the error of the prefix-sum workload A (lower-triangular ones) is
||A C^-1||_F^2 times the squared sensitivity. The column-normalized kind rescales the
last b-1 columns, which the run's end truncates, to norm 1 as well
(`cocoon_ckpt.dp.column_normalized`): C is then banded but not Toeplitz.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.column_normalized import (
    column_normalized_loss,
    column_scales,
    dense_column_normalized,
)

__all__ = ["BandMF", "MechanismKind"]


class MechanismKind(enum.StrEnum):
    """How the band coefficients were chosen (a privacy-neutral, utility choice)."""

    BANDED_SQRT = "banded_sqrt"
    """Closed form: the first b coefficients of the square root of A, binom(2j, j)/4^j."""
    OPTIMIZED = "optimized"
    """Minimised prefix-sum error under the column-norm constraint."""
    CUSTOM = "custom"
    """Coefficients supplied by the caller."""
    OPTIMIZED_COLNORM = "optimized_colnorm"
    """`optimized`'s coefficients, every column of C scaled to norm 1 (jax_privacy's
    column normalization for a known n): the last b-1 steps' noise is multiplied by
    s_t < 1, the same sigma and epsilon, 0-3% less error (most at small n / large b)."""
    BLT = "blt"
    """A buffered linear Toeplitz strategy (`cocoon_ckpt.dp.blt.strategy.BLT`, fitted by
    `optimized_blt` for the run's steps with bands as its min-sep): d buffers of noise
    state instead of b-1, accounted without amplification (`dp.blt.accounting`)."""


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


def _reflection_to_polynomial(k: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Levinson step-up: reflection coefficients k (m,) to monic c_0..c_m.

    Every k in (-1, 1)^m gives a polynomial 1 + c_1 z + ... + c_m z^m with no root in the
    closed unit disc, and every such polynomial has one such k: exactly the C whose
    inverse stays bounded in n. Also returns each step's padded predecessor, which the
    vector-Jacobian product below reuses.
    """
    a = np.ones(1)
    padded = []
    for ki in k:
        p = np.append(a, 0.0)
        padded.append(p)
        a = p + ki * p[::-1]
    return a, padded


def _reflection_vjp(k: np.ndarray, padded: list[np.ndarray], grad_c: np.ndarray) -> np.ndarray:
    """d loss / d k from d loss / d c, reversing `_reflection_to_polynomial`, (m,)."""
    g = grad_c
    grad_k = np.empty(len(k))
    for i in range(len(k) - 1, -1, -1):
        p = padded[i]
        grad_k[i] = g @ p[::-1]
        g = (g + k[i] * g[::-1])[:-1]
    return grad_k


def _polynomial_to_reflection(c: np.ndarray) -> np.ndarray:
    """Levinson step-down, the inverse of `_reflection_to_polynomial` (c_0 scaled to 1)."""
    a = np.asarray(c, dtype=np.float64) / c[0]
    k = np.empty(len(a) - 1)
    for i in range(len(a) - 1, 0, -1):
        k[i - 1] = a[i]
        a = (a[:i] - a[i] * a[i:0:-1]) / (1.0 - a[i] * a[i])
    return k


def _error_and_gradient(c: np.ndarray, n: int) -> tuple[float, np.ndarray]:
    """||A C^-1||_F^2 * ||c||^2 (scale-free in c) and its gradient in c, O(n b).

    With d = C^-1 e_0 and e = cumsum(d), the error is sum_k (n - k) e_k^2. As C and C^-1
    are lower-triangular Toeplitz they commute with the shift S, so dd/dc_i = -S^i C^-1 d
    and de/dc_i = -S^i q with q = cumsum(C^-1 d): two banded solves, no dense n x n.
    `BandMF.loss` keeps its own plain recursion: it is the referee `optimized` checks
    its result against.
    """
    from scipy.linalg import lapack

    b = len(c)
    ab = np.repeat(c[:, None], n, axis=1)  # LAPACK lower band storage: ab[j, t] = C[t + j, t]
    e0 = np.zeros((n, 1))
    e0[0, 0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        d, _ = lapack.dtbtrs(ab, e0, uplo="L")
        q, _ = lapack.dtbtrs(ab, d, uplo="L")
        e = np.cumsum(d[:, 0])
        q = np.cumsum(q[:, 0])
        we = np.arange(n, 0, -1, dtype=np.float64) * e
        err = float(we @ e)
        norm2 = float(c @ c)
        grad_err = np.array([-2.0 * (we[i:] @ q[: n - i]) for i in range(b)])
        return err * norm2, norm2 * grad_err + 2.0 * err * c


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

        Runs L-BFGS from the banded square root over the reflection coefficients
        k_i = tanh(theta_i) of c, so every iterate has C^-1 bounded (see
        `_reflection_to_polynomial`). In c itself one L-BFGS step can leave that region
        (for b = 2, c_1 >= 1), where C^-1 grows like c_1^n, the loss overflows and the
        search stops at its start. The result is never worse than `banded_sqrt` on
        `loss()`, and the same inputs give the same bits.

        Args:
            bands: b, the number of coefficients.
            steps: n, the number of steps.
            max_iter: most L-BFGS iterations.
        """
        # scipy loads here, not at import: `cocoon-ckpt inspect` and other store-only
        # commands never need it and start in a fraction of the time.
        from scipy.optimize import minimize

        start = cls.banded_sqrt(bands, steps)
        if bands == 1:
            return cls(start.coefficients, steps=steps, kind=MechanismKind.OPTIMIZED)

        def loss_and_grad(theta: np.ndarray) -> tuple[float, np.ndarray]:
            k = np.tanh(theta)
            c, padded = _reflection_to_polynomial(k)
            loss, grad_c = _error_and_gradient(c, steps)
            if not math.isfinite(loss):
                # Reachable only with |k_i| near 1, where C^-1's transient growth can
                # still overflow; L-BFGS-B then stops at its last finite iterate.
                return math.inf, np.zeros_like(theta)
            return loss, _reflection_vjp(k, padded, grad_c) * (1.0 - k * k)

        # The banded square root has positive, strictly decreasing coefficients, so by
        # Enestrom-Kakeya its roots lie outside the closed unit disc: every |k_i| < 1.
        theta0 = np.arctanh(_polynomial_to_reflection(start.coefficients))
        # Stop on relative reduction only: the loss is O(n^2), so an absolute gradient
        # tolerance means something different at each n. 1e-12 costs a few more
        # (O(n b)) iterations and reaches the optimum to about 1e-12 relative.
        res = minimize(
            loss_and_grad,
            theta0,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": max_iter, "ftol": 1e-12, "gtol": 0.0},
        )
        best, _ = _reflection_to_polynomial(np.tanh(res.x))
        if not np.all(np.isfinite(best)) or cls(best, steps=steps).loss() > start.loss():
            best = start.coefficients
        return cls(best, steps=steps, kind=MechanismKind.OPTIMIZED)

    @classmethod
    def optimized_colnorm(cls, bands: int, steps: int, *, max_iter: int = 500) -> BandMF:
        """`optimized`, then column-normalized (see `column_normalize`)."""
        return cls.column_normalize(cls.optimized(bands, steps, max_iter=max_iter))

    @classmethod
    def column_normalize(cls, mechanism: BandMF) -> BandMF:
        """The column-normalized form of an `optimized` mechanism.

        Its coefficients are `mechanism`'s bit for bit, so steps t <= n-b add exactly
        the noise `optimized` adds. Re-optimising c under the column-normalized loss
        was measured to gain under 0.02% more for b <= 16 (0.33% at n = 128, b = 64),
        and jax_privacy does not do it either.

        Raises:
            ValueError: `mechanism` is not of kind `optimized`.
        """
        if mechanism.kind is not MechanismKind.OPTIMIZED:
            raise ValueError(
                f"mechanism is {mechanism.kind.value}; column normalization is offered for "
                "optimized only: build it with BandMF.optimized(bands, steps)"
            )
        out = cls(
            mechanism.coefficients, steps=mechanism.steps, kind=MechanismKind.OPTIMIZED_COLNORM
        )
        out._c = mechanism._c  # read-only already; normalising again could move an ulp
        return out

    # properties ------------------------------------------------------------------
    @property
    def coefficients(self) -> np.ndarray:
        """c_0..c_{b-1}, float64, scaled so C's largest column norm is 1."""
        return self._c

    @property
    def bands(self) -> int:
        return len(self._c)

    @property
    def is_column_normalized(self) -> bool:
        """Whether C's truncated last columns are scaled to norm 1 (non-Toeplitz C)."""
        return self.kind is MechanismKind.OPTIMIZED_COLNORM

    def noise_scale(self, t: int) -> float:
        """s_t, the factor step t's recursion output is multiplied by before it is added
        (C^-1 = diag(s) C_T^-1); the ring keeps the unscaled output. Exactly 1.0 for
        every Toeplitz kind and for t <= steps - b.

        Raises:
            ValueError: t is not a step of the run.
        """
        if not self.is_column_normalized:
            return 1.0
        if not 0 <= t < self.steps:
            raise ValueError(
                f"t={t} is not a step of this {self.steps}-step column-normalized mechanism; "
                f"its noise exists for 0 <= t < {self.steps}"
            )
        if t <= self.steps - self.bands:
            return 1.0
        return float(column_scales(self._c, self.steps)[t])

    @property
    def sensitivity(self) -> float:
        """Largest column norm of C (1 by construction)."""
        return float(np.linalg.norm(self._c))

    def matrix(self, n: int | None = None) -> np.ndarray:
        """Dense C, (n, n) float64 (n defaults to `steps`). For tests and audit."""
        n = self.steps if n is None else n
        if self.is_column_normalized:
            return dense_column_normalized(self._c, self.steps, n)
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
        if self.is_column_normalized:
            return column_normalized_loss(self._c, self.steps, n)
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
