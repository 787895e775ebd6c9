"""BLT: the buffered linear Toeplitz strategy matrix C and its one noise step.

A BLT with buffer decays theta (d,) and output scales omega (d,) is the lower-triangular
Toeplitz C1 with C1[t, t] = 1 and C1[t, t-k] = sum_i omega_i theta_i^(k-1) for k >= 1
(Dvijotham et al., "Efficient and near-optimal noise generation for streaming
differential privacy", 2024; jax_privacy's `BufferedToeplitz` uses the same
parameters; d, the buffer count, is the degree of that paper's rational function, and
m stays the model dimension of docs/notation.md). Its inverse is again a BLT
(theta_hat, omega_hat) with d buffers (`inverse_parameters`), so the noise w = C^-1 z
needs d buffers of the model's size instead of BandMF's b-1 past outputs, whatever the
number of steps.

As `BandMF`, C is scaled so its largest column norm (column 0, over `steps` rows) is 1:
C = c_0 C1. With alpha_i = c_0 omega_i the recursion C w = z reads

    w_t = (z_t - sum_i alpha_i buf_i) / c_0,    then    buf_i <- theta_i buf_i + w_t,

where buf_i = sum_{k>=1} theta_i^(k-1) w_{t-k} (zeros before step 0): BandMF's step with
the ring of past outputs replaced by d decaying sums of them (`blt_step`).

Sensitivity: under b-min-separated participation C is not banded, so columns of
repeated participations overlap; `BLT.sensitivity` is the min-sep sensitivity of
`cocoon_ckpt.dp.blt.accounting`, which says how a run is accounted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cocoon_ckpt._state_dict import check_state
from cocoon_ckpt.dp.elementwise import sub_div_
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.dp.ring import RingHistory

__all__ = ["BLT", "blt_step", "minsep_sensitivity_squared", "pair_from_decays"]


def _vector(name: str, value: Any) -> np.ndarray:
    out = np.array(value, dtype=np.float64).reshape(-1)
    if np.ndim(value) > 1:
        raise ValueError(f"{name} must be a vector, got shape {np.shape(value)}")
    if not np.all(np.isfinite(out)):
        raise ValueError(f"{name}={out.tolist()} must be finite")
    return out


def pair_from_decays(theta: np.ndarray, theta_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Output scales (omega, omega_hat) of the BLT pair C1 = (theta, omega) and
    C1^-1 = (theta_hat, omega_hat), from both decay vectors.

    The generating function of C1 is prod_j (1 - theta_hat_j x) / prod_i (1 - theta_i x);
    partial fractions give omega_i = prod_j (theta_i - theta_hat_j) /
    prod_{j != i} (theta_i - theta_j) (Dvijotham et al. 2024, Lemma 5.2; McMahan and
    Pillutla 2025, Theorem 2). Needs distinct decays within each vector.

    Args:
        theta: (d,) buffer decays of C1.
        theta_hat: (d,) buffer decays of C1^-1.

    Returns:
        (omega, omega_hat), each (d,) float64.
    """

    def scales(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        diff = a[:, None] - a[None, :]
        np.fill_diagonal(diff, 1.0)
        out: np.ndarray = np.prod(a[:, None] - b[None, :], axis=1) / np.prod(diff, axis=1)
        return out

    theta = np.asarray(theta, dtype=np.float64)
    theta_hat = np.asarray(theta_hat, dtype=np.float64)
    return scales(theta, theta_hat), scales(theta_hat, theta)


def _inverse_parameters(theta: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(theta_hat, omega_hat) of C1^-1 by diagonalising the inverse's state matrix.

    C1^-1 runs the buffers with state matrix diag(theta) - omega 1^T (the recursion in
    the module docstring with c_0 = 1); its eigenvalues are the inverse's decays and the
    eigenvectors have the closed form omega_i / (lambda - theta_i) (jax_privacy's
    `BufferedToeplitz.inverse`, after Dvijotham et al. 2024, Prop. 5.6).
    """
    m = len(theta)
    if m == 0:
        return theta.copy(), omega.copy()
    state = np.diag(theta) - np.outer(omega, np.ones(m))
    evals = np.linalg.eigvals(state)
    if np.max(np.abs(evals.imag)) > 1e-9 * max(1.0, float(np.max(np.abs(evals)))):
        raise ValueError(
            f"BLT theta={theta.tolist()} omega={omega.tolist()}: its inverse has complex "
            "buffer decays; use parameters with omega > 0 and sum(omega / theta) < 1"
        )
    lam = np.sort(evals.real)[::-1]
    evecs = omega[:, None] / (lam[None, :] - theta[:, None])
    omega_hat = (np.linalg.solve(evecs, -omega)) * (evecs.T @ np.ones(m))
    return lam, omega_hat


def minsep_sensitivity_squared(
    coefficients: np.ndarray, min_sep: int, n: int, max_participations: int | None = None
) -> float:
    """Squared L2 sensitivity of a lower-triangular Toeplitz C under min-sep participation.

    A unit takes part in at most k = min(max_participations, ceil(n / min_sep)) steps,
    any two at least min_sep apart. For non-negative non-increasing coefficients the
    worst pattern is k steps exactly min_sep apart from step 0, and the sensitivity is
    the norm of the sum of those columns (jax_privacy `toeplitz.minsep_sensitivity_squared`;
    McMahan et al., arXiv:2405.13763, Thm. 2). Other coefficients are first replaced by
    their running maximum of absolute values from the tail, which bounds it from above.

    Args:
        coefficients: C's first column (any length; padded with zeros or cut to n).
        min_sep: b, the least distance between two participations (1: any steps).
        n: steps (rows of C).
        max_participations: a cap on k, or None for ceil(n / min_sep).

    Returns:
        The squared sensitivity, in units of the per-step contribution bound.
    """
    if min_sep < 1:
        raise ValueError(f"min_sep={min_sep} must be >= 1 (1 allows every step)")
    k = -(-n // min_sep)
    if max_participations is not None:
        k = min(k, max_participations)
    coef = np.zeros(n + (-n) % min_sep)
    head = np.abs(np.asarray(coefficients, dtype=np.float64)[:n])
    coef[: len(head)] = np.maximum.accumulate(head[::-1])[::-1]
    v = coef.reshape(-1, min_sep).cumsum(axis=0).reshape(-1)
    # Drop participations beyond the k-th: cumsum over k columns min_sep apart.
    v[min_sep * k :] = v[min_sep * k :] - v[: len(v) - min_sep * k]
    return float(v[:n] @ v[:n])


class BLT:
    """A buffered linear Toeplitz strategy for `steps` steps (d buffers).

    Use `cocoon_ckpt.dp.blt.optimize.optimized_blt` for a strategy fitted to the
    prefix-sum workload under b-min-separated participation.

    Args:
        buf_decay: theta, (d,) decays in (0, 1), distinct.
        output_scale: omega, (d,) scales of C1 (jax_privacy's parameters, c_0 = 1).
        steps: n, the steps the strategy serves (C's scale depends on it).

    Raises:
        ValueError: a parameter is malformed (the message names it).
    """

    def __init__(self, buf_decay: Any, output_scale: Any, *, steps: int) -> None:
        theta = _vector("buf_decay", buf_decay)
        omega = _vector("output_scale", output_scale)
        if theta.shape != omega.shape:
            raise ValueError(
                f"buf_decay has {len(theta)} buffers, output_scale {len(omega)}: give one "
                "scale per buffer"
            )
        if not np.all((theta > 0) & (theta < 1)):
            raise ValueError(f"buf_decay={theta.tolist()} must lie in (0, 1)")
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"Expected steps={steps!r} >= 1")
        order = np.argsort(-theta, kind="stable")
        self._theta = theta[order]
        self._omega = omega[order]
        self.steps = steps
        col = self._unit_coefficients(steps)
        self._c0 = 1.0 / float(np.linalg.norm(col))
        for a in (self._theta, self._omega):
            a.setflags(write=False)

    # parameters ------------------------------------------------------------------
    @property
    def kind(self) -> MechanismKind:
        """`MechanismKind.BLT`, as `BandMF.kind` names its kind."""
        return MechanismKind.BLT

    @property
    def buffers(self) -> int:
        """d, the number of buffers (0: C = I, DP-SGD)."""
        return len(self._theta)

    @property
    def buf_decay(self) -> np.ndarray:
        """theta, (d,) float64, decreasing."""
        return self._theta

    @property
    def output_scale(self) -> np.ndarray:
        """omega, (d,) float64, C1's scales (c_0 = 1)."""
        return self._omega

    @property
    def c0(self) -> float:
        """C's diagonal: 1 / (column-0 norm of C1 over `steps` rows)."""
        return self._c0

    @property
    def mixing_vector(self) -> np.ndarray:
        """alpha = c_0 omega, (d,) float64: the weights of the buffers in each step."""
        return self._c0 * self._omega

    def _unit_coefficients(self, n: int) -> np.ndarray:
        k = np.arange(max(n - 1, 0), dtype=np.float64)
        tail = (self._theta[None, :] ** k[:, None]) @ self._omega
        return np.concatenate([[1.0], tail])[:n]

    def coefficients(self, n: int | None = None) -> np.ndarray:
        """C's first column, (n,) float64 (n defaults to `steps`)."""
        n = self.steps if n is None else n
        return self._c0 * self._unit_coefficients(n)

    def matrix(self, n: int | None = None) -> np.ndarray:
        """Dense C, (n, n) float64. For tests and audit."""
        n = self.steps if n is None else n
        c = self.coefficients(n)
        idx = np.arange(n)
        lag = idx[:, None] - idx[None, :]
        return np.where(lag >= 0, c[np.clip(lag, 0, None)], 0.0)

    def inverse_parameters(self) -> tuple[np.ndarray, np.ndarray]:
        """(theta_hat, omega_hat), each (d,): C1^-1 is the BLT with these parameters,
        so C^-1 = C1^-1 / c_0 has first column [1, sum omega_hat theta_hat^(k-1)] / c_0.

        Raises:
            ValueError: the inverse's decays are not real (outside the class the
                optimiser searches: omega > 0, sum(omega / theta) < 1).
        """
        return _inverse_parameters(np.array(self._theta), np.array(self._omega))

    def inverse_coefficients(self, n: int | None = None) -> np.ndarray:
        """C^-1's first column, (n,) float64, from `inverse_parameters`."""
        n = self.steps if n is None else n
        th, om = self.inverse_parameters()
        k = np.arange(max(n - 1, 0), dtype=np.float64)
        tail = (th[None, :] ** k[:, None]) @ om
        return np.concatenate([[1.0], tail])[:n] / self._c0

    # error and sensitivity -------------------------------------------------------
    def loss(self, n: int | None = None) -> float:
        """Prefix-sum workload error ||A C^-1||_F^2 with C at single-participation
        sensitivity 1: `BandMF.loss`'s definition, so the two compare per participation.

        C^-1's first column is run through the recursion (`blt_step`'s arithmetic on one
        coordinate), not read from `inverse_parameters`, so this is an independent check
        of the inverse. O(n d).
        """
        n = self.steps if n is None else n
        d = np.empty(n)
        bufs = np.zeros(self.buffers)
        alpha = self.mixing_vector
        for t in range(n):
            d[t] = ((1.0 if t == 0 else 0.0) - alpha @ bufs) / self._c0
            bufs = self._theta * bufs + d[t]
        e = np.cumsum(d)
        return float(np.arange(n, 0, -1, dtype=np.float64) @ (e * e))

    def sensitivity(self, min_sep: int, max_participations: int | None = None) -> float:
        """L2 sensitivity of C over `steps` under min-sep participation (clip units).

        1 when one participation is possible (min_sep >= steps); more otherwise, as the
        columns of C overlap (see `minsep_sensitivity_squared`).
        """
        return math.sqrt(
            minsep_sensitivity_squared(self.coefficients(), min_sep, self.steps, max_participations)
        )

    def minsep_loss(self, min_sep: int, max_participations: int | None = None) -> float:
        """`loss()` times the squared min-sep sensitivity: the error at unit noise
        multiplier of the unamplified Gaussian mechanism that accounts a BLT run.
        jax_privacy's min-sep mean loss (`LossFn.build_min_sep(error="mean")`) is this
        divided by `steps`."""
        return self.loss() * self.sensitivity(min_sep, max_participations) ** 2

    # state -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "BLT",
            "schema_version": 1,
            "steps": self.steps,
            "buf_decay": [float(x) for x in self._theta],
            "output_scale": [float(x) for x in self._omega],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> BLT:
        check_state(state, "BLT", 1)
        return cls(state["buf_decay"], state["output_scale"], steps=int(state["steps"]))

    def __repr__(self) -> str:
        return f"BLT(buffers={self.buffers}, steps={self.steps})"


def blt_step(
    blt: BLT,
    t: int,
    z: torch.Tensor,
    buffers: RingHistory,
    *,
    mix: np.ndarray | None = None,
    after_gemv: Callable[[int], None] | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """One step of the BLT recursion, w_t = (z_t - sum_i alpha_i buf_i) / c_0, then
    buf_i <- theta_i buf_i + w_t for each buffer.

    Bit for bit the same wherever it runs: the weighted sum over buffers is the history
    GEMV in its one order of rounding (`cocoon_ckpt.dp.gemv`), the rest is elementwise
    in `z`'s dtype (theta cast to it first, each product and sum rounded on its own).

    Args:
        blt: the strategy (d buffers).
        t: the step, >= 0 (the buffers must hold step t's state; zeros at step 0).
        z: fresh noise z_t at the buffers' coordinates, (width,) float32 or float64.
        buffers: (d, width) buffers in `z`'s dtype, any `RingHistory`; updated here.
        mix: `blt.mixing_vector`, when the caller has it already.
        after_gemv: called with t once the GEMV is done, before the buffers are written.
        in_place: w_t is computed into `z` itself (the same kernels, the same bits).

    Returns:
        w_t, (width,), a fresh tensor (`z` itself when `in_place`).
    """
    if t < 0:
        raise ValueError(f"step t={t} must be >= 0")
    if not blt.buffers:
        return z.div_(blt.c0) if in_place else z / blt.c0
    h = buffers.gemv(blt.mixing_vector if mix is None else mix)
    if after_gemv is not None:
        after_gemv(t)
    if in_place:
        w = sub_div_(z, h, blt.c0)
    else:
        w = (z - torch.from_numpy(h)) / blt.c0
    w_np = w.numpy()
    decay = blt.buf_decay.astype(w_np.dtype)
    for i in range(blt.buffers):
        buffers.write(i, decay[i] * buffers.read(i) + w_np)
    return w
