"""Fitting a BLT to the prefix-sum workload under b-min-separated participation.

The objective is `BLT.minsep_loss`: ||A C^-1||_F^2 (the loss `BandMF.optimized`
minimises, A the prefix sums) times C's squared min-sep sensitivity, the error at unit
noise multiplier of the unamplified Gaussian mechanism a BLT run is accounted as
(`cocoon_ckpt.dp.blt.accounting`). It is jax_privacy's
`LossFn.build_min_sep(error="mean")` times n, minimised the way jax_privacy does
(`buffered_toeplitz.optimize_loss`, McMahan et al., "Hassle-free BLT", 2024):

- over the pair of decay vectors (theta of C, theta_hat of C^-1), each in (0, 1), the
  output scales following in closed form (`pair_from_decays`), so no eigenproblem is
  differentiated;
- with the same log barriers, 1e-8 times the loss normalised by its rough optimum,
  keeping the search among well-behaved BLTs (McMahan and Pillutla 2025, Thm. 1):
  omega > 0, omega_hat < 0, distinct decays, sum(omega) < 1 and sum(omega / theta) < 1;
  these also make C's coefficients positive and decreasing, where the min-sep
  sensitivity is exact;
- from two starts, the better kept (`_best_fit`): the rational approximation of
  1 / sqrt(1 - x) (Dvijotham et al. 2024, Prop. 4.5), its decays scaled to at most
  1 - 1/n, and decays spread from 1 - 1/n to 0.1;
- adding buffers while each cuts the loss by at least 1% (`optimized_blt(buffers=None)`).

The loss and its gradient come from torch autograd in float64; scipy's L-BFGS-B runs
the search over logits of the decays, so every iterate keeps them in (0, 1).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from cocoon_ckpt.dp.blt.strategy import BLT, pair_from_decays

__all__ = ["blt_objective", "job_blt", "optimized_blt", "rational_approx_blt"]

_PENALTY = 1e-8
_MIN_GAP = 1e-12
#: What the search sees outside the barriers' region (finite: L-BFGS-B needs one).
_INFEASIBLE = 1e30


def rational_approx_blt(buffers: int, steps: int, *, max_decay: float = 1 - 1e-6) -> BLT:
    """The BLT whose inverse approximates sqrt(1 - x) with `buffers` terms (RA-BLT).

    jax_privacy's `from_rational_approx_to_sqrt_x` with its defaults (decay scale 1.6,
    shift -1), then decays scaled to at most `max_decay` and scales so that
    sum(omega / theta) <= max_decay: a feasible start for the optimiser.

    Args:
        buffers: d >= 1.
        steps: n.
        max_decay: the largest decay and the largest sum(omega / theta) allowed.
    """
    if buffers < 1:
        raise ValueError(f"buffers={buffers} must be >= 1 for a rational approximation")
    d1 = (buffers + 1) // 2
    h = 1.6 * math.pi / math.sqrt(2 * (d1 + 1))
    ks = np.arange(-d1 + 1, buffers - d1 + 1, dtype=np.float64) - 1
    inv_decay = 1.0 / (1.0 + np.exp(2 * h * ks))
    inv_scale = -(inv_decay**2) * np.exp(3 * h * ks) / np.sum(np.exp(h * ks) * inv_decay)
    # (inv_decay, inv_scale) is C1^-1; the inverse of a BLT's inverse is C1 itself.
    theta, omega = BLT(inv_decay, inv_scale, steps=steps).inverse_parameters()
    theta = theta * min(1.0, max_decay / theta[0])
    score = float(np.sum(omega / theta))
    omega = omega * min(1.0, max_decay / score)
    return BLT(theta, omega, steps=steps)


def _scales(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`pair_from_decays`'s closed form in torch (differentiable)."""
    diff = a[:, None] - a[None, :] + torch.eye(len(a), dtype=a.dtype)
    return torch.prod(a[:, None] - b[None, :], dim=1) / torch.prod(diff, dim=1)


def _column(decay: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    k = torch.arange(n - 1, dtype=decay.dtype)
    tail = (decay[None, :] ** k[:, None]) @ scale
    return torch.cat([torch.ones(1, dtype=decay.dtype), tail])


def _minsep_sens2(c: torch.Tensor, min_sep: int, k: int) -> torch.Tensor:
    n = len(c)
    # `minsep_sensitivity_squared` in torch: exact for positive decreasing c, which the
    # barriers keep; the projection keeps it an upper bound anywhere else.
    c = torch.flip(torch.cummax(torch.flip(torch.abs(c), [0]), 0).values, [0])
    c = torch.cat([c, torch.zeros((-n) % min_sep, dtype=c.dtype)])
    v = c.reshape(-1, min_sep).cumsum(0).reshape(-1)
    if min_sep * k < len(v):
        v = torch.cat([v[: min_sep * k], v[min_sep * k :] - v[: len(v) - min_sep * k]])
    v = v[:n]
    return v @ v


def blt_objective(
    theta: torch.Tensor, theta_hat: torch.Tensor, steps: int, min_sep: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, penalised loss) of the BLT pair with decays (theta, theta_hat).

    loss = ||A C^-1||_F^2 * sens_minsep(C)^2, scale-free in C (`BLT.minsep_loss`);
    the penalised loss is it over its rough optimum n (k + (1 + ln n / pi)^2) plus
    1e-8 times the barriers (module docstring); inf outside their region.

    Args:
        theta: (d,) float64 decays of C1.
        theta_hat: (d,) float64 decays of C1^-1.
        steps: n.
        min_sep: b.
    """
    n = steps
    k = -(-n // min_sep)
    omega, omega_hat = _scales(theta, theta_hat), _scales(theta_hat, theta)
    c = _column(theta, omega, n)
    d = _column(theta_hat, omega_hat, n)
    e = torch.cumsum(d, 0)
    weights = torch.arange(n, 0, -1, dtype=theta.dtype)
    loss = (weights * e * e).sum() * _minsep_sens2(c, min_sep, k)
    barriers = [
        theta,
        1 - theta,
        omega,
        theta_hat,
        1 - theta_hat,
        -omega_hat,
        (1 - omega.sum()).reshape(1),
        (1 - (omega / theta).sum()).reshape(1),
    ]
    if len(theta) > 1:
        for a in (theta, theta_hat):
            gaps = torch.abs(a[:, None] - a[None, :]) + torch.diag(torch.full_like(a, math.inf))
            barriers.append((gaps.min() - _MIN_GAP).reshape(1))
    flat = torch.cat(barriers)
    if not bool(torch.all(flat > 0)) or not bool(torch.isfinite(loss)):
        inf = torch.tensor(math.inf, dtype=theta.dtype)
        return inf, inf
    scale = n * (k + (1 + math.log(n) / math.pi) ** 2)
    return loss, loss / scale + _PENALTY * (-torch.log(flat).sum())


def _to_gaps(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """Logits of the 2m + 1 gaps of 1 > theta_1 > theta_hat_1 > ... > theta_hat_m > 0."""
    values = np.empty(2 * len(theta))
    values[0::2], values[1::2] = theta, theta_hat
    gaps = -np.diff(np.concatenate([[1.0], values, [0.0]]))
    if not np.all(gaps > 0):
        raise ValueError(
            f"BLT decays theta={theta.tolist()} and its inverse's theta_hat="
            f"{theta_hat.tolist()} do not interlace; start from `rational_approx_blt`"
        )
    out: np.ndarray = np.log(gaps)
    return out


def _from_gaps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values = 1.0 - torch.cumsum(torch.softmax(x, 0), 0)[:-1]
    return values[0::2], values[1::2]


def _fit(start: BLT, steps: int, min_sep: int, max_iter: int) -> tuple[BLT, float]:
    # Searched over interlaced decays 1 > theta_1 > theta_hat_1 > ... > theta_hat_m > 0,
    # as softmax gaps: interlacing gives omega > 0, omega_hat < 0, sum(omega) < 1 and
    # sum(omega / theta) = 1 - prod(theta_hat / theta) < 1, so every iterate lies inside
    # the barriers. A search in the raw decays steps outside them, where L-BFGS-B's line
    # search cannot use an infinite value and stops at its start.
    from scipy.optimize import minimize

    theta_hat0, _ = start.inverse_parameters()
    x0 = _to_gaps(start.buf_decay, np.sort(theta_hat0)[::-1])

    def value_and_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        _, penalised = blt_objective(*_from_gaps(xt), steps, min_sep)
        if not bool(torch.isfinite(penalised)):
            return _INFEASIBLE, np.zeros_like(x)
        (grad,) = torch.autograd.grad(penalised, xt)
        if not bool(torch.all(torch.isfinite(grad))):
            return _INFEASIBLE, np.zeros_like(x)
        return float(penalised.detach()), grad.numpy().copy()

    res = minimize(
        value_and_grad,
        x0,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": max_iter, "maxcor": 15, "ftol": 1e-12, "gtol": 1e-10},
    )
    with torch.no_grad():
        theta_t, theta_hat_t = _from_gaps(torch.tensor(res.x, dtype=torch.float64))
    theta, theta_hat = theta_t.numpy(), theta_hat_t.numpy()
    omega, _ = pair_from_decays(theta, theta_hat)
    start_loss = start.minsep_loss(min_sep)
    try:
        blt = BLT(theta, omega, steps=steps)
        loss = blt.minsep_loss(min_sep)
    except ValueError:  # decays merged in float64: keep the start
        return start, start_loss
    if not math.isfinite(loss) or loss > start_loss:
        return start, start_loss
    return blt, loss


def _spread_start(buffers: int, steps: int) -> BLT:
    # Decays with 1 - theta log-spaced from 1/n to 0.9, sum(omega / theta) = 1/2.
    theta = 1.0 - np.logspace(math.log10(1.0 / steps), math.log10(0.9), buffers)
    return BLT(theta, 0.5 * theta / buffers, steps=steps)


def _best_fit(buffers: int, steps: int, min_sep: int, max_iter: int) -> tuple[BLT, float]:
    # Two starts, the better result kept. jax_privacy's RA-BLT start puts every decay
    # near 1, and in the softmax gaps L-BFGS-B stalls there: measured, n = 16, b = 4,
    # one buffer ends at 23.28 from decay 1 - 1e-6 against jax_privacy's 16.50, and
    # n = 256, b = 64, two buffers at 34.46 against 33.52 (the optimum has a decay near
    # 0.47). The RA-BLT scaled to 1 - 1/n and decays spread from 1 - 1/n to 0.1 reach
    # jax_privacy's loss on every golden setting between them.
    fits = [
        _fit(start, steps, min_sep, max_iter)
        for start in (
            _spread_start(buffers, steps),
            rational_approx_blt(buffers, steps, max_decay=1.0 - 1.0 / steps),
        )
    ]
    return min(fits, key=lambda fit: fit[1])


def optimized_blt(
    steps: int,
    min_sep: int,
    buffers: int | None = None,
    *,
    max_buffers: int = 8,
    rtol: float = 1.01,
    max_iter: int = 600,
) -> BLT:
    """The BLT minimising `BLT.minsep_loss(min_sep)` over `steps` steps.

    Deterministic: the same inputs give the same bits on one machine.

    Args:
        steps: n, the number of steps.
        min_sep: b, the least separation of two participations (the cyclic Poisson
            sampler's bands).
        buffers: d, or None to add buffers from 1 while each cuts the loss by the
            factor rtol (jax_privacy's `optimize`), up to `max_buffers`.
        max_buffers: the most buffers tried when `buffers` is None.
        rtol: the least loss ratio for which one more buffer is kept.
        max_iter: L-BFGS iterations per buffer count.

    Returns:
        The fitted strategy (m = 0 when no buffer beats DP-SGD's identity).
    """
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} must be an integer >= 2 to fit a BLT")
    if not isinstance(min_sep, int) or min_sep < 1:
        raise ValueError(f"min_sep={min_sep!r} must be an integer >= 1")
    if buffers is not None:
        if buffers < 0:
            raise ValueError(f"buffers={buffers} must be >= 0")
        if buffers == 0:
            return BLT([], [], steps=steps)
        return _best_fit(buffers, steps, min_sep, max_iter)[0]
    best = BLT([], [], steps=steps)
    best_loss = best.minsep_loss(min_sep)
    for m in range(1, max_buffers + 1):
        blt, loss = _best_fit(m, steps, min_sep, max_iter)
        if rtol * loss >= best_loss:
            break
        best, best_loss = blt, loss
    return best


@functools.lru_cache(maxsize=32)
def job_blt(steps: int, min_sep: int) -> BLT:
    """`optimized_blt(steps, min_sep)`, fitted once per process: a job's calibration,
    its trainer and a plan ask for the same strategy, and a fit takes seconds. A resume
    never calls this: it rebuilds the strategy from the parameters the store holds
    (a refit elsewhere may differ in the last bits, and the noise with it).

    The strategy is shared: its parameter arrays are read-only.
    """
    return optimized_blt(steps, min_sep)
