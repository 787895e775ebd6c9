"""Accounting cost: epsilon at every checkpoint, and noise_multiplier_for, against
dp-accounting used directly, side by side in one process.

    python bench/accounting.py [--steps 300] [--every 10] [--bands 8] [--batch 32]
                               [--dataset 2048] [--sigma 1.0] [--no-calibrate-baseline]

1. A job of `--steps` steps checkpointing every `--every` steps reports epsilon at each
   checkpoint: ours (`cocoon_ckpt.dp.accountant.epsilon`, caches cleared first, as in a
   fresh process) against a fresh `PLDAccountant` composing the event at each
   checkpoint (what the engine did before). The values must be equal; the script says
   so. Defaults: the mlp example's privacy settings.
2. `noise_multiplier_for` for a few targets against dp-accounting's
   `calibrate_dp_mechanism` on the reported grid (the engine's search before), with the
   epsilon each answer gets under the reported accounting.
"""

from __future__ import annotations

import argparse
import math
import time

import dp_accounting
from dp_accounting import pld

from cocoon_ckpt.dp import accountant
from cocoon_ckpt.dp.accountant import dp_event, epsilon, noise_multiplier_for


def _clear() -> None:
    accountant.clear_caches()


def _direct(sigma: float, n: int, batch: int, steps: int, bands: int, delta: float) -> float:
    acc = pld.PLDAccountant()
    acc.compose(dp_event(sigma, n, batch, steps, bands))
    return float(acc.get_epsilon(delta))


def _calibrate(target: float, n: int, batch: int, steps: int, bands: int, delta: float) -> float:
    return float(
        dp_accounting.calibrate_dp_mechanism(
            pld.PLDAccountant,
            lambda s: dp_event(s, n, batch, steps, bands),
            target,
            delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(0.3, 1.0),
            tol=1e-4,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--bands", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dataset", type=int, default=2048)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--no-calibrate-baseline", action="store_true")
    a = p.parse_args()
    cps = list(range(a.every, a.steps + 1, a.every))
    args = (a.sigma, a.dataset, a.batch)
    print(
        f"job: sigma={a.sigma} N={a.dataset} B={a.batch} b={a.bands} q="
        f"{a.batch * a.bands / a.dataset:.4f}, {a.steps} steps, {len(cps)} checkpoints "
        f"({len({math.ceil(s / a.bands) for s in cps})} distinct round counts)"
    )
    _clear()
    t = time.perf_counter()
    first = epsilon(*args, cps[0], a.bands, a.delta)
    t_first = time.perf_counter() - t
    ours = [first] + [epsilon(*args, s, a.bands, a.delta) for s in cps[1:]]
    t_ours = time.perf_counter() - t
    t = time.perf_counter()
    theirs = [_direct(*args, s, a.bands, a.delta) for s in cps]
    t_theirs = time.perf_counter() - t
    rest = (t_ours - t_first) / max(1, len(cps) - 1)
    print(
        f"epsilon at every checkpoint: ours {t_ours:.2f} s (first {t_first:.2f} s, then "
        f"{rest * 1e3:.0f} ms each), PLDAccountant {t_theirs:.2f} s "
        f"({t_theirs / len(cps) * 1e3:.0f} ms each); ratio {t_theirs / t_ours:.1f}x; "
        f"values equal: {ours == theirs} (final epsilon {ours[-1]:.6f})"
    )
    _clear()
    t = time.perf_counter()
    last = epsilon(*args, a.steps, a.bands, a.delta)
    print(f"epsilon once at the end (a fresh process's cost): {time.perf_counter() - t:.2f} s")
    del last

    print(
        f"{'target':>6} {'N':>6} {'B':>4} {'n':>5} {'b':>3} {'ours s':>7} {'sigma':>9} "
        f"{'eps':>8} {'calibrate s':>11} {'sigma':>9} {'ratio':>6}"
    )
    for target, n, batch, steps, bands in [
        (4.0, 10_000, 100, 400, 4),
        (8.0, 2048, 32, 300, 8),
        (1.0, 60_000, 256, 1000, 1),
    ]:
        _clear()
        t = time.perf_counter()
        sigma = noise_multiplier_for(target, n, batch, steps, bands, a.delta)
        t_nm = time.perf_counter() - t
        eps = epsilon(sigma, n, batch, steps, bands, a.delta)
        if a.no_calibrate_baseline:
            base = "-"
        else:
            t = time.perf_counter()
            s_cal = _calibrate(target, n, batch, steps, bands, a.delta)
            t_cal = time.perf_counter() - t
            base = f"{t_cal:>11.2f} {s_cal:>9.5f} {t_cal / t_nm:>6.1f}"
        print(
            f"{target:>6} {n:>6} {batch:>4} {steps:>5} {bands:>3} {t_nm:>7.2f} {sigma:>9.5f} "
            f"{eps:>8.5f} {base}"
        )


if __name__ == "__main__":
    main()
