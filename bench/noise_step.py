"""History GEMV bytes/s against a memory-bandwidth probe, and keyed fresh-noise
samples/s against plain torch.randn, side by side in one process.

    python bench/noise_step.py [--dim 4194304] [--bands 8 32 64]

The probe is a large numpy copy counted as bytes read + written (STREAM's convention);
the GEMV reads (b-1) x dim floats of ring history with the engine's fixed-order kernel
(`cocoon_ckpt.gemv`); OpenBLAS sgemv over the same ring is printed beside it, for the
price of bit-identical noise on any split.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from cocoon_ckpt import BandMF, CorrelatedNoise, KeyedNoise
from cocoon_ckpt.gemv import mix_history


def best_of(fn, repeat: int = 7) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 22)
    p.add_argument("--bands", type=int, nargs="+", default=[8, 32, 64])
    args = p.parse_args()
    m = args.dim
    src = np.random.default_rng(0).random(1 << 26, dtype=np.float32)  # 256 MiB
    dst = np.empty_like(src)
    t_copy = best_of(lambda: np.copyto(dst, src))
    copy_bw = 2 * src.nbytes / t_copy
    print(f"probe: numpy copy {src.nbytes >> 20} MiB, {copy_bw / 1e9:.1f} GB/s (read+write)")
    print(
        f"{'b':>4} {'history MiB':>12} {'GEMV GB/s':>10} {'ratio':>6} {'BLAS GB/s':>10} "
        f"{'GEMV/BLAS':>9}"
    )
    key = bytes(32)
    rng = np.random.default_rng(0)
    for b in args.bands:
        mech = BandMF.banded_sqrt(b, 4 * b)
        ring = rng.standard_normal((b - 1, m), dtype=np.float32)
        mix = mech.mixing_vector(b + 3).astype(np.float32)
        # the engine's kernel (one order of rounding), and OpenBLAS sgemv for reference
        t = best_of(lambda: mix_history(mix, ring))  # noqa: B023 - evaluated inside the loop
        t_blas = best_of(lambda: mix @ ring)  # noqa: B023
        bw = ring.nbytes / t
        print(
            f"{b:>4} {ring.nbytes / 2**20:>12.0f} {bw / 1e9:>10.1f} {bw / copy_bw:>6.2f} "
            f"{ring.nbytes / t_blas / 1e9:>10.1f} {t_blas / t:>9.2f}"
        )
    kn = KeyedNoise(key, m, 1.0)
    t_ours = best_of(lambda: kn.fresh(7))
    t_randn = best_of(lambda: torch.randn(m))
    print(
        f"fresh noise: keyed {m / t_ours / 1e6:.0f} M samples/s, torch.randn "
        f"{m / t_randn / 1e6:.0f} M samples/s, ratio {t_randn / t_ours:.2f}"
    )
    step = CorrelatedNoise(BandMF.banded_sqrt(32, 200), m, key, 1.0)
    for _ in range(32):
        step.step()
    t_step = best_of(step.step, repeat=5)
    print(f"full noise step (b=32, dim {m}): {t_step * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
