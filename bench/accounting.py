"""Accounting cost: epsilon at every checkpoint, and noise_multiplier_for, against
dp-accounting used directly, side by side in one process.

    python bench/accounting.py [--steps 300] [--every 10] [--bands 8] [--batch 32]
                               [--dataset 2048] [--sigma 1.0] [--no-calibrate-baseline]

1. A job of `--steps` steps checkpointing every `--every` steps reports epsilon at each
   checkpoint: ours (`cocoon_ckpt.dp.accounting.epsilon`, caches cleared first, as in a
   fresh process) against a fresh `PLDAccountant` composing the event at each
   checkpoint (what the engine did before). The values must be equal; the script says
   so. Defaults: the mlp example's privacy settings.
2. The accounting a `--steps` job pays checkpointing every `--every` steps against
   checkpointing once (epsilon at each checkpoint plus the final report, fresh caches),
   for this engine and for the one before 2026-12-03 (dp-accounting's own one-round
   build and epsilon loop, emulated in this process); the extra seconds are what the
   cadence adds to the job's wall time (a writer computes them, the GIL mostly free).
3. `noise_multiplier_for` for a few targets against dp-accounting's
   `calibrate_dp_mechanism` on the reported grid (the engine's search before), with the
   epsilon each answer gets under the reported accounting, and the same search on the
   engine before 2026-12-03.
4. `--job N`: the real mlp example at both cadences, N alternating pairs of whole
   processes, wall and cpu ratios (`bench/cadence.py`'s comparison, for `--steps` and
   `--every`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time
from collections.abc import Iterator

import cadence  # bench/cadence.py, beside this script
import dp_accounting
from dp_accounting import pld

from cocoon_ckpt.dp.accounting import _pld_kernels, accountant, pld_composition, pld_gaussian
from cocoon_ckpt.dp.accounting.amplified import dp_event, epsilon
from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for


def _clear() -> None:
    accountant.clear_caches()


@contextlib.contextmanager
def _engine_before() -> Iterator[None]:
    """The cached composition as it was before 2026-12-03: dp-accounting's one-round
    build (a Python call per grid point) and its compose-and-epsilon (Python loops)."""
    module, one_round = vars(pld_composition), pld_composition.OneRound
    build, eps = module["subsampled_gaussian"], one_round.epsilon
    module["subsampled_gaussian"] = lambda s, q, d: pld_gaussian._build(s, q, d, False)
    one_round.epsilon = one_round._epsilon_by_accountant  # type: ignore[method-assign]
    _clear()
    try:
        yield
    finally:
        module["subsampled_gaussian"] = build
        one_round.epsilon = eps  # type: ignore[method-assign]
        _clear()


def _cadence_cost(
    args: tuple[float, int, int], steps: int, every: int, bands: int, delta: float
) -> float:
    """Seconds of accounting a job pays: epsilon at each checkpoint, then the final
    report (a fresh process: caches cleared)."""
    _clear()
    t = time.perf_counter()
    for s in [*range(every, steps + 1, every), steps]:
        epsilon(*args, s, bands, delta)
    return time.perf_counter() - t


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
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--bands", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dataset", type=int, default=2048)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--no-calibrate-baseline", action="store_true")
    p.add_argument("--job", type=int, default=0, help="pairs of real mlp jobs (0: none)")
    a = p.parse_args()
    # One-time costs of a process (numba's cached kernels, the per-process self-checks)
    # are paid here, not by the first timed epsilon.
    _pld_kernels.agree()
    pld_gaussian._agrees()
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

    print(f"accounting of the whole job, every {a.every} steps vs once (fresh caches):")
    for name, ctx in (("now", contextlib.nullcontext()), ("before", _engine_before())):
        with ctx:
            often = _cadence_cost(args, a.steps, a.every, a.bands, a.delta)
            once = _cadence_cost(args, a.steps, a.steps, a.bands, a.delta)
        print(
            f"  {name:>6}: every {a.every} {often:.2f} s, once {once:.2f} s, the cadence "
            f"adds {often - once:.2f} s"
        )

    print(
        f"{'target':>6} {'N':>6} {'B':>4} {'n':>5} {'b':>3} {'ours s':>7} {'sigma':>9} "
        f"{'eps':>8} {'before s':>8} {'sigma':>9} {'calibrate s':>11} {'sigma':>9} {'ratio':>6}"
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
        with _engine_before():
            t = time.perf_counter()
            s_before = noise_multiplier_for(target, n, batch, steps, bands, a.delta)
            t_before = time.perf_counter() - t
        if a.no_calibrate_baseline:
            base = "-"
        else:
            t = time.perf_counter()
            s_cal = _calibrate(target, n, batch, steps, bands, a.delta)
            t_cal = time.perf_counter() - t
            base = f"{t_cal:>11.2f} {s_cal:>9.5f} {t_cal / t_nm:>6.1f}"
        print(
            f"{target:>6} {n:>6} {batch:>4} {steps:>5} {bands:>3} {t_nm:>7.2f} {sigma:>9.5f} "
            f"{eps:>8.5f} {t_before:>8.2f} {s_before:>9.5f} {base}"
        )

    if a.job:
        print(cadence.compare("mlp", a.job, a.every, a.steps))


if __name__ == "__main__":
    main()
