"""Column normalization of a banded Toeplitz strategy, as jax_privacy does it.

A b-banded Toeplitz C_T of n steps has column norms ||c|| = 1 except its last b-1
columns, which the end of the run truncates: column t holds c_0..c_{n-1-t} only. Scaling
every column to norm 1 gives C = C_T diag(1/s) with s_t = ||c_{0..min(b, n-t)-1}||, so
C^-1 = diag(s) C_T^-1: the noise is the Toeplitz recursion's output with step t's
output multiplied by s_t (1 for t <= n-b, below 1 after), and the ring keeps holding
the unscaled recursion (jax_privacy's `toeplitz.inverse_as_streaming_matrix(coef,
column_normalize_for_n=n)`, its `row_scale`).

C stays lower-triangular and b-banded and its largest column norm stays 1, which is all
the amplified accounting uses (docs/notation.md, "Column normalization"), so sigma and
epsilon are those of the Toeplitz C; only the error falls, by the noise the last b-1
steps no longer add.
"""

from __future__ import annotations

import numpy as np

__all__ = ["column_normalized_loss", "column_scales", "dense_column_normalized"]


def column_scales(c: np.ndarray, steps: int) -> np.ndarray:
    """s_t, the factor step t's noise is multiplied by, for t < steps, (steps,) float64.

    Exactly 1.0 wherever the column holds every band (t <= steps - b), so those steps'
    noise is the Toeplitz noise bit for bit; below that, ||c_{0..steps-t-1}|| / ||c||:
    the ratio keeps the largest column norm of C at ||c||, the Toeplitz one.

    Args:
        c: c_0..c_{b-1}, (b,) float64, b <= steps.
        steps: n, the steps the strategy serves.
    """
    b = len(c)
    s = np.ones(steps)
    tail = np.sqrt(np.cumsum(c[: b - 1] ** 2)) / np.linalg.norm(c)  # ||c_{0..k}||, k < b-1
    # Column t = steps - 1 - k keeps c_0..c_k.
    s[steps - 1 - np.arange(min(b - 1, steps))] = tail[: min(b - 1, steps)]
    return s


def _inverse_first_column(c: np.ndarray, n: int) -> np.ndarray:
    """First column d of C_T^-1 (lower-triangular Toeplitz too), (n,), by LAPACK."""
    from scipy.linalg import lapack

    ab = np.repeat(c[:, None], n, axis=1)  # band storage: ab[j, t] = C_T[t + j, t]
    e0 = np.zeros((n, 1))
    e0[0, 0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        d, _ = lapack.dtbtrs(ab, e0, uplo="L")
    return np.asarray(d[:, 0])


def column_normalized_loss(c: np.ndarray, steps: int, n: int | None = None) -> float:
    """||A C^-1||_F^2 ||c||^2 for the leading n x n block of the column-normalized C of a
    `steps`-step run (n defaults to steps), in O(n b).

    Rows i below the first scaled step r are the Toeplitz rows, A C_T^-1 row i being
    e_{i-u} with e = cumsum(d), d = C_T^-1 e_0: together sum_k (r - k) e_k^2. Each later
    row adds s_i times row i of C_T^-1 (d reversed) to the row before it. ||c||^2 is C's
    squared sensitivity, as in `BandMF.loss`.

    Args:
        c: c_0..c_{b-1}, (b,) float64.
        steps: the run's n, which sets the scales.
        n: rows and columns of the block, <= steps.

    Raises:
        ValueError: n exceeds steps (the run has no columns there to normalize).
    """
    n = steps if n is None else n
    if not 1 <= n <= steps:
        raise ValueError(
            f"n={n} must lie in [1, steps={steps}]: a column-normalized C is defined for "
            "its run's steps only; build the mechanism for more steps"
        )
    s = column_scales(c, steps)[:n]
    d = _inverse_first_column(c, n)
    e = np.cumsum(d)
    r = int(np.argmax(s < 1.0)) if np.any(s < 1.0) else n  # first scaled step
    err = float(np.arange(r, 0, -1, dtype=np.float64) @ (e[:r] * e[:r]))
    row = np.zeros(n)
    row[:r] = e[r - 1 :: -1] if r else 0.0  # A C^-1 row r-1: e_{r-1-u} for u < r
    for i in range(r, n):
        row[: i + 1] += s[i] * d[i::-1]
        err += float(row @ row)
    return err * float(c @ c)


def dense_column_normalized(c: np.ndarray, steps: int, n: int | None = None) -> np.ndarray:
    """The leading n x n block of C, dense, (n, n) float64: the reference for tests and
    `BandMF.matrix` (column t of the banded Toeplitz divided by s_t)."""
    n = steps if n is None else n
    if not 1 <= n <= steps:
        raise ValueError(
            f"n={n} must lie in [1, steps={steps}]: a column-normalized C is defined for "
            "its run's steps only; build the mechanism for more steps"
        )
    out = np.zeros((n, n))
    for j, cj in enumerate(c[:n]):
        idx = np.arange(j, n)
        out[idx, idx - j] = cj
    result: np.ndarray = out / column_scales(c, steps)[None, :n]
    return result
