"""The tiered history GEMV against the two baselines, side by side in one run.

    python bench/tiers.py [--dim 4194304] [--bands 32] [--host-frac 0.4]
                          [--link-gbps 5] [--device-frac 0] [--reps 7] [--far-dir /dev/shm]

The history ((b-1) x dim float32) is larger than the host tier's cap, so the rest must
live far: in the emulated CXL tier (a file in --far-dir, /dev/shm by default, streamed
by a worker process that computes next to it), behind a link throttled to --link-gbps
(0: no throttle, the file's own speed: a folder on a local disk for a ring beyond RAM). Three
engines over the same data, one process, one run:

  planned   tiers profiled and split by the planner, each computing where its data lies
  GPU-GEMV  every shard pulled to the device tier, which computes all of it
  CPU-GEMV  every shard pulled to the host, which computes all of it

(Both baselines keep the history where it fits: host up to its cap, the rest far; a
pulled shard streams in 8 MiB chunks, the next crossing while one is computed.)

It prints each engine's median GEMV time, planned / better baseline (target <= 0.7),
whether the results are bit-identical, the planner's pick against the brute-force
optimum of the measured profile, the measured time against the slowest tier's modelled
time (max, not sum), and the far pull's measured time against bytes / bandwidth.

On a machine without CUDA the device tier is torch on the CPU: emulated, and it competes
with the host tier for the same cores. The far tier is always emulated.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np

from cocoon_ckpt.dp.gemv import mix_history
from cocoon_ckpt.tiers import GemvMode, TierConfig, TieredHistory, build_history
from cocoon_ckpt.tiers.device import default_device
from cocoon_ckpt.tiers.history import PULL_CHUNK_BYTES


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def brute_force(units: int, sec: dict[str, float], cap: dict[str, int]) -> float:
    names = [n for n in cap if cap[n]]
    best = float("inf")
    for combo in itertools.product(*(range(min(cap[n], units) + 1) for n in names)):
        if sum(combo) == units:
            best = min(best, max(k * sec[n] for k, n in zip(combo, names, strict=True)))
    return best


def main() -> None:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--dim", type=int, default=1 << 22, help="model dimension m")
    p.add_argument("--bands", type=int, default=32, help="b; the history is (b-1) x m")
    p.add_argument(
        "--host-frac", type=float, default=0.4, help="host cap as a fraction of the history"
    )
    p.add_argument(
        "--device-frac",
        type=float,
        default=0.0,
        help="device cap for history as a fraction of the history (0: the device holds the "
        "merge buffer only; on a CPU-only machine a device share competes for the cores)",
    )
    p.add_argument("--link-gbps", type=float, default=5.0, help="far link, GB/s")
    p.add_argument("--unit-blocks", type=int, default=2, help="allocation unit, 65536-blocks")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--far-dir", default="/dev/shm", help="folder of the far tier's file")
    args = p.parse_args()

    slots, dim = args.bands - 1, args.dim
    item = 4
    hist = slots * dim * item
    unit = args.unit_blocks * (1 << 16)
    merge = -(-dim // unit) * unit * item
    host_cap = int(hist * args.host_frac)
    dev_cap = merge + int(hist * args.device_frac)
    link = args.link_gbps * 1e9 or None
    rng = np.random.default_rng(0)
    ring = rng.standard_normal((slots, dim), dtype=np.float32)
    mix = rng.standard_normal(slots)
    want = mix_history(mix, ring)
    print(
        f"history {slots} x {dim} float32 = {hist / 2**20:.0f} MiB; host cap "
        f"{host_cap / 2**20:.0f} MiB; device cap {dev_cap / 2**20:.0f} MiB (merge buffer "
        f"{merge / 2**20:.0f} MiB) on {default_device()}"
        + (" (emulated)" if default_device().type != "cuda" else "")
        + f"; far file in {args.far_dir}, link "
        + (f"{args.link_gbps:g} GB/s (emulated CXL)" if link else "not throttled")
    )
    common = {
        "host_bytes": host_cap,
        "far_bytes": 2 * hist,
        "far_dir": args.far_dir,
        "far_link_bytes_per_s": link,
        "unit_blocks": args.unit_blocks,
    }
    engines = {
        "planned": TierConfig(device_bytes=dev_cap, mode=GemvMode.NEAR_DATA, **common),
        "GPU-GEMV": TierConfig(
            device_bytes=merge, mode=GemvMode.PULL_TO_DEVICE, counts=None, **common
        ),
        "CPU-GEMV": TierConfig(device_bytes=0, mode=GemvMode.PULL_TO_HOST, **common),
    }
    results: dict[str, float] = {}
    planned: TieredHistory | None = None
    for name, cfg in engines.items():
        h = build_history(slots, dim, "float32", cfg)
        try:
            h.scatter(ring)
            same = np.array_equal(h.gemv(mix), want)
            results[name] = timed(lambda: h.gemv(mix), args.reps)  # noqa: B023
            where = ", ".join(
                f"{q['tier']} {(q['stop'] - q['start']) * slots * item / 2**20:.0f} MiB"
                for q in h.placement()
            )
            print(f"{name:>9}: {results[name] * 1e3:8.1f} ms  bit-identical={same}  [{where}]")
            if name == "planned":
                planned = h
                plan = h.plan or {}
                sec, caps = plan["seconds_per_unit"], plan["capacity_units"]
                bf = brute_force(plan["units"], sec, caps)
                print(
                    f"           plan {plan['counts']} of {plan['units']} units; profile "
                    + ", ".join(f"{k} {v * 1e3:.2f} ms/unit" for k, v in sec.items())
                )
                print(
                    f"           planner's modelled max {plan['predicted_s'] * 1e3:.1f} ms, "
                    f"brute force {bf * 1e3:.1f} ms: ratio {plan['predicted_s'] / bf:.3f} "
                    "(target <= 1.05)"
                )
                alone = {}
                for t, lo, hi in h.ranges:
                    if hi > lo:
                        alone[t.name] = timed(lambda t=t: t.submit_gemv(mix).result(), 3)
                print(
                    "           each tier alone: "
                    + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in alone.items())
                    + f"; together {results[name] * 1e3:.1f} ms = "
                    f"{results[name] / max(alone.values()):.2f} x max, "
                    f"{results[name] / sum(alone.values()):.2f} x sum (target <= 1.15 x max)"
                )
                far = next(t for t, lo, hi in h.ranges if t.name == "far")
                if far.width:
                    # in the chunks a baseline pulls, so the copy itself is not what we time
                    step = PULL_CHUNK_BYTES // (slots * item)
                    cuts = [*range(0, far.width, step), far.width]

                    def pull_all(far=far, cuts=cuts) -> None:  # type: ignore[no-untyped-def]
                        for lo, hi in itertools.pairwise(cuts):
                            far.pull(lo, hi)

                    t_pull = timed(pull_all, 3)
                    said = (
                        f"           far pull {far.nbytes / 2**20:.0f} MiB: {t_pull * 1e3:.1f} ms"
                    )
                    if link is not None:
                        model = far.nbytes / link
                        said += (
                            f" measured, {model * 1e3:.1f} ms modelled (bytes / bandwidth): "
                            f"ratio {t_pull / model:.3f} (target within 0.85-1.15)"
                        )
                    print(said)
        finally:
            if h is not planned:
                h.close()
    if planned is not None:
        planned.close()
    better = min(results["GPU-GEMV"], results["CPU-GEMV"])
    print(
        f"planned / better baseline = {results['planned'] / better:.3f} (target <= 0.7); "
        f"GPU-GEMV {results['GPU-GEMV'] * 1e3:.1f} ms, CPU-GEMV {results['CPU-GEMV'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
