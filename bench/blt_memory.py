"""Noise-state bytes per parameter: BLT (d buffers) against BandMF at the same or less error.

    python bench/blt_memory.py [--settings 64:4 256:16 1024:32] [--epsilon 2 8]

Two comparisons per (n steps, b = min-separation = the sampler's partitions):

1. The same mechanism class, unamplified (the math alone): the min-sep loss
   (||A C^-1||_F^2 times the squared min-sep sensitivity) of the fitted BLT, and of
   `BandMF.optimized(b')` for b' = 1..b (b' <= b keeps its participations' columns
   disjoint, so its squared sensitivity is the participation count k = ceil(n / b)).
   Printed: the BLT's buffers and bytes per parameter (float32), the fewest bands whose
   BandMF error is at most the BLT's, its bytes, and the ratio.
2. At a target epsilon, each with its own accounting (what `plan` would compare):
   BandMF(b) amplified (`noise_multiplier_for`, q = B b / N) against the BLT as one
   Gaussian at its min-sep sensitivity (`blt_noise_multiplier_for`); predicted error =
   loss at unit sensitivity times sigma^2, N = 60,000, B = 256, delta = 1e-6.

Prints ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import math

from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
from cocoon_ckpt.dp.blt.accounting import blt_noise_multiplier_for
from cocoon_ckpt.dp.blt.optimize import optimized_blt
from cocoon_ckpt.dp.mechanism import BandMF

FLOAT32 = 4
N_DATA, BATCH, DELTA = 60_000, 256, 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--settings", nargs="+", default=["64:4", "256:16", "1024:32"])
    ap.add_argument("--epsilon", nargs="+", type=float, default=[2.0, 8.0])
    args = ap.parse_args()
    print("unamplified, same participation (min-sep loss / n; bytes per parameter, float32)")
    print(
        f"{'n':>6} {'b':>4} {'BLT d':>6} {'BLT err':>10} {'bytes':>6} "
        f"{'BandMF b_':>9} {'err':>10} {'bytes':>6} {'ratio':>6}"
    )
    fitted = {}
    for spec in args.settings:
        n, b = (int(x) for x in spec.split(":"))
        blt = optimized_blt(n, b)
        fitted[(n, b)] = blt
        blt_err = blt.minsep_loss(b) / n
        k = math.ceil(n / b)
        match = None
        for bands in range(1, b + 1):
            band_err = k * BandMF.optimized(bands, n).loss() / n
            if band_err <= blt_err:
                match = (bands, band_err)
                break
        blt_bytes = blt.buffers * FLOAT32
        if match is None:
            best = k * BandMF.optimized(b, n).loss() / n
            print(
                f"{n:>6} {b:>4} {blt.buffers:>6} {blt_err:>10.4g} {blt_bytes:>6} "
                f"{'> ' + str(b):>9} {best:>10.4g} {(b - 1) * FLOAT32:>6} {'-':>6}"
            )
        else:
            bands, band_err = match
            band_bytes = (bands - 1) * FLOAT32
            ratio = f"{band_bytes / blt_bytes:.2f}" if blt_bytes else "-"
            print(
                f"{n:>6} {b:>4} {blt.buffers:>6} {blt_err:>10.4g} {blt_bytes:>6} "
                f"{bands:>9} {band_err:>10.4g} {band_bytes:>6} {ratio:>6}"
            )
    print()
    print(f"at target epsilon, each its own accounting (N={N_DATA}, B={BATCH}, delta={DELTA})")
    print(
        f"{'eps':>5} {'n':>6} {'b':>4} {'BandMF sigma':>12} {'err':>10} "
        f"{'BLT sigma':>10} {'err':>10} {'BLT/BandMF':>10}"
    )
    for eps in args.epsilon:
        for (n, b), blt in fitted.items():
            band = BandMF.optimized(b, n)
            s_band = noise_multiplier_for(eps, N_DATA, BATCH, n, b, DELTA)
            s_blt = blt_noise_multiplier_for(eps, blt.sensitivity(b), DELTA)
            e_band, e_blt = band.loss() * s_band**2 / n, blt.loss() * s_blt**2 / n
            print(
                f"{eps:>5g} {n:>6} {b:>4} {s_band:>12.4g} {e_band:>10.4g} "
                f"{s_blt:>10.4g} {e_blt:>10.4g} {e_blt / e_band:>10.3f}"
            )


if __name__ == "__main__":
    main()
