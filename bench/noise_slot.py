"""The BandMF step in its ring slot, fused and through a kept scratch, against the step
through kept (width,) buffers, side by side in one process (#31 item 2).

    python bench/noise_slot.py [--dim 16777216] [--bands 4] [--rounds 7]
        [--parts P ...] [--dtype float32]

All are `BandMFNoise.step(out=)` on a host ring over the same key and shard. "kept" is
the step as it was first: z_t drawn into the caller's buffer, the GEMV's h into the
noise's own, w = (z - h) / c_0 in z's buffer, then w copied into ring slot t mod (b-1).
"scratch, P parts" computes w_t in the ring's slot, the width cut in P parts of whole
noise blocks computed one after the other, each by three kernels (the GEMV into a kept
scratch of one part, the draw into the slot, the subtraction and division); the
default P is the step before the fused pass (parts of at most 2^25 coordinates: 3 at
85M, a 109 MiB scratch). "fused" is the step now: one compiled pass over the whole
width, each noise block's GEMV, draw and division on one thread, no scratch
(`cocoon_ckpt.dp.noise.bandmf_step_in_slot`, `cocoon_ckpt.dp._slot_kernel`).
All give the same bits (checked here every round). Each figure is the median and the
best of `--rounds` rounds, the contenders alternating within each round (their order
rotated each round) so that a drift in the machine's speed hits all; the ratios are of
the same run (< 1: faster). Each contender has its own noise (a ring and a (dim,)
buffer): 1.3 GB at the defaults, 4.5 GB at 85M.
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
    p.add_argument("--parts", type=int, nargs="+", default=None)
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    args = p.parse_args()
    key = bytes(32)
    print(
        f"dim {args.dim}, {args.dtype}, torch threads {torch.get_num_threads()}, "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(
        f"{'b':>3} {'contender':>18} {'median ms':>10} {'best ms':>8} {'÷kept (median)':>15} "
        f"{'÷scratch (median)':>18}"
    )
    tdt = getattr(torch, args.dtype)
    for b in args.bands:
        mech = BandMF.banded_sqrt(b, 100 * b)
        parts_list = args.parts or [-(-args.dim // (1 << 25))]
        contenders = [("kept", 0), *((f"scratch, {k} parts", k) for k in parts_list)]
        noises: dict[str, BandMFNoise] = {}
        for name, parts in [*contenders, ("fused", -1)]:
            noise = noises[name] = BandMFNoise(mech, args.dim, key, 1.0, args.dtype)
            if parts > 0:
                noise.slot_min_width, noise.slot_part_width = 1, -(-args.dim // parts)
                noise.slot_fused_min_elements = 1 << 62  # never fused
            elif parts < 0:
                noise.slot_min_width = noise.slot_fused_min_elements = 1
            else:
                noise.slot_min_width = 1 << 62  # never in the slot
        outs = {name: torch.empty(args.dim, dtype=tdt) for name in noises}
        fns: dict[str, Callable[[], torch.Tensor]] = {
            name: (lambda n=n, o=outs[name]: n.step(o)) for name, n in noises.items()
        }
        times: dict[str, list[float]] = {n: [] for n in fns}
        # warm-up: first-touch pages, compiled kernels, and every slot written once
        for _ in range(b):
            for fn in fns.values():
                fn()
        names = list(fns)
        for r in range(args.rounds):
            ws: dict[str, torch.Tensor] = {}
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                ws[name] = fns[name]()
                times[name].append(time.perf_counter() - t0)
            # each contender took one step a round: the same t, so the same w_t
            if not all(torch.equal(ws["kept"], w) for w in ws.values()):
                raise SystemExit("a step in the slot differs from the kept buffers' step")
        for n in noises.values():
            if not np.array_equal(n.history.gather(), noises["kept"].history.gather()):
                raise SystemExit("a ring in the slot differs from the kept buffers' ring")
        base = statistics.median(times["kept"])
        before = statistics.median(times[contenders[1][0]])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{b:>3} {name:>18} {med * 1e3:>10.1f} {min(ts) * 1e3:>8.1f} "
                f"{med / base:>15.2f} {med / before:>18.2f}"
            )
        for n in noises.values():
            n.close()
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
