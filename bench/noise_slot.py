"""The BandMF step in its ring slot against the step through kept (width,) buffers,
side by side in one process (#31 item 2).

    python bench/noise_slot.py [--dim 16777216] [--bands 4] [--rounds 7]
        [--parts 1 2 4] [--dtype float32]

Both are `BandMFNoise.step(out=)` on a host ring over the same key and shard. "kept" is
the step as it was: z_t drawn into the caller's buffer, the GEMV's h into the noise's
own, w = (z - h) / c_0 in z's buffer, then w copied into ring slot t mod (b-1).
"slot" computes w_t in the ring's slot itself, the width cut in `--parts` parts of
whole noise blocks computed one after the other
(`cocoon_ckpt.dp.noise.bandmf_step_in_slot`; `BandMFNoise.slot_part_width` sets the
default: parts of at most 2^25 coordinates).
Both give the same bits (checked here every round). Each figure is the median and the
best of `--rounds` rounds, the contenders alternating within each round so that a drift
in the machine's speed hits all; the ratio is slot ÷ kept of the same run (< 1: the slot
is faster). Each contender has its own noise (a ring and a (dim,) buffer): 1.3 GB at
the defaults.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.mechanism import BandMF


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 24)
    p.add_argument("--bands", type=int, nargs="+", default=[4])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args()
    key = bytes(32)
    print(
        f"dim {args.dim}, {args.dtype}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'b':>3} {'contender':>14} {'median ms':>10} {'best ms':>8} {'÷kept (median)':>15}")
    tdt = getattr(torch, args.dtype)
    for b in args.bands:
        mech = BandMF.banded_sqrt(b, 100 * b)
        noises: dict[str, BandMFNoise] = {}
        for name, parts in [("kept", 0), *((f"slot, {k} parts", k) for k in args.parts)]:
            noise = noises[name] = BandMFNoise(mech, args.dim, key, 1.0, args.dtype)
            if parts:
                noise.slot_min_width, noise.slot_part_width = 1, -(-args.dim // parts)
            else:
                noise.slot_min_width = 1 << 62  # never in the slot
        outs = {name: torch.empty(args.dim, dtype=tdt) for name in noises}
        fns: dict[str, Callable[[], torch.Tensor]] = {
            name: (lambda n=n, o=outs[name]: n.step(o)) for name, n in noises.items()
        }
        times: dict[str, list[float]] = {n: [] for n in fns}
        # warm-up: first-touch pages, compiled kernels, and every slot written once
        for _ in range(b):
            ws = [fn() for fn in fns.values()]
        for _ in range(args.rounds):
            ws = []
            for name, fn in fns.items():
                t0 = time.perf_counter()
                ws.append(fn())
                times[name].append(time.perf_counter() - t0)
            # each contender took one step a round: the same t, so the same w_t
            if not all(torch.equal(ws[0], w) for w in ws[1:]):
                raise SystemExit("the slot's step differs from the kept buffers' step")
        for n in noises.values():
            if not np.array_equal(n.history.gather(), noises["kept"].history.gather()):
                raise SystemExit("the slot's ring differs from the kept buffers' ring")
        base = statistics.median(times["kept"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{b:>3} {name:>14} {med * 1e3:>10.1f} {min(ts) * 1e3:>8.1f} {med / base:>15.2f}")
        for n in noises.values():
            n.close()
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
