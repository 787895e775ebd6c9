"""Physical-batch chunking of per-sample gradients: peak memory and speed against one vmap
of the whole logical batch, on an MLP whose per-sample gradients dominate memory.

    python bench/physical_batch.py [--hidden 512] [--logical 4096] [--physical 64]
        [--speed-batch 1024] [--speed-physical 64 128 256] [--repeats 3] [--quick]

Peak memory: each configuration runs `PerSampleGrads.clipped_sum` once in a fresh
subprocess, so the peak is its own. The figure is the process's peak RSS during the step
above its RSS after building the model and data and a 2-example warm-up (which loads
torch.func's machinery): the peak counter is reset there by writing 5 to
/proc/self/clear_refs (Linux), then read as VmHWM; where that reset is refused the
figure is ru_maxrss minus that RSS, which is the same unless the import itself peaked
higher. RSS counts what the allocator really touched, with no tracing overhead
(tracemalloc does not see torch's allocations). Configurations: logical `--logical`
with physical `--physical`; logical `--physical` unchunked (the baseline: what the
physical batch alone costs); 256 and 1,024 unchunked (the slope per example); logical
`--logical` unchunked only when the slope predicts under half of MemAvailable,
otherwise it is skipped with the reason and extrapolated from the slope, labelled so.
The printed ratio is (logical / physical chunked) ÷ (physical unchunked): near 1 when
memory follows the physical batch.

Speed: one logical batch of `--speed-batch` examples, physical `--speed-physical` and one
vmap of the whole batch, in one process, the configurations interleaved in each of
`--repeats` rounds after one warm-up each; medians, and each chunked time ÷ the whole
batch's. The sums' largest difference from the whole batch's is printed beside them
(the chunked sum differs in the last bits: see `cocoon_ckpt.train.grads`).

The default run takes ~4 minutes on a loaded 2-core machine; `--quick` (about a minute
and a half there): logical 1,024 / physical 64, speed batch 256 with physical 64 and 128,
3 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from cocoon_ckpt.train.grads import PerSampleGrads

FEATURES, CLASSES, MAX_GRAD_NORM = 784, 10, 1.0
MIB = 1 << 20


def build(hidden: int, n: int) -> tuple[PerSampleGrads, list[torch.Tensor]]:
    """The MLP (784-hidden-hidden-10) and n examples of random data, seeded."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, CLASSES),
    )
    names = [k for k, _ in model.named_parameters()]
    psg = PerSampleGrads(model, nn.functional.cross_entropy, names)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return psg, [x, y]


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this benchmark needs Linux")


def child(hidden: int, logical: int, physical: int | None) -> None:
    """One configuration, in this (fresh) process: prints one JSON line."""
    psg, batch = build(hidden, logical)
    psg.clipped_sum([d[:2] for d in batch], MAX_GRAD_NORM)  # warm-up: torch.func, pools
    base = status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    t = time.perf_counter()
    psg.clipped_sum(batch, MAX_GRAD_NORM, physical)
    seconds = time.perf_counter() - t
    # ru_maxrss is KiB on Linux; VmHWM after the reset is the step's own peak
    peak = status_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {"dim": psg.dim, "base_kib": base, "peak_kib": peak, "reset": reset, "s": seconds}
        )
    )


def run_child(hidden: int, logical: int, physical: int | None) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", str(hidden), str(logical), str(physical or 0)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    r["extra_mib"] = (r["peak_kib"] - r["base_kib"]) / 1024
    return r


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable: this benchmark needs Linux")


def memory_table(hidden: int, logical: int, physical: int) -> None:
    print("peak RSS of one clipped_sum above the built model and data (fresh process each):")
    print(f"{'logical':>8} {'physical':>9} {'extra MiB':>10} {'grads MiB':>10} {'step s':>7}")
    rows: dict[tuple[int, int | None], dict[str, float]] = {}

    def row(n: int, p: int | None) -> dict[str, float]:
        r = rows[(n, p)] = run_child(hidden, n, p)
        # one chunk's per-sample gradients: what chunking bounds
        grads = min(n, p or n) * r["dim"] * 4 / MIB
        print(
            f"{n:>8} {p or '-':>9} {r['extra_mib']:>10.1f} {grads:>10.1f} {r['s']:>7.2f}"
            + ("" if r["reset"] else "  (ru_maxrss: peak reset refused)")
        )
        return r

    chunked = row(logical, physical)
    alone = row(physical, None)
    ladder = sorted({n for n in (256, 1024) if physical < n < logical})
    for n in ladder:
        row(n, None)
    pts = [(physical, alone["extra_mib"])] + [(n, rows[(n, None)]["extra_mib"]) for n in ladder]
    (n0, m0), (n1, m1) = pts[0], pts[-1]
    slope = (m1 - m0) / (n1 - n0) if n1 > n0 else m0 / n0
    predicted = m1 + slope * (logical - n1)
    avail = mem_available_mib()
    if predicted < avail / 2:
        whole = row(logical, None)["extra_mib"]
        label = "measured"
    else:
        whole = predicted
        label = "EXTRAPOLATED"
        print(
            f"{logical:>8} {'-':>9} {predicted:>10.1f}  EXTRAPOLATED, not run: "
            f"{n0}..{n1} unchunked slope {slope:.2f} MiB/example predicts "
            f"{predicted / 1024:.1f} GiB >= half of MemAvailable ({avail / 1024:.1f} GiB)"
        )
    print(
        f"ratio (logical {logical} / physical {physical}) ÷ (logical {physical} unchunked): "
        f"{chunked['extra_mib'] / alone['extra_mib']:.2f} (target ~1)"
    )
    print(f"logical {logical} unchunked ÷ chunked: {whole / chunked['extra_mib']:.1f}x ({label})")


def speed_table(hidden: int, n: int, physicals: list[int], repeats: int) -> None:
    psg, batch = build(hidden, n)
    configs: list[int | None] = [p for p in physicals if p < n] + [None]
    times: dict[int | None, list[float]] = {p: [] for p in configs}
    sums: dict[int | None, torch.Tensor] = {}
    for p in configs:
        sums[p] = psg.clipped_sum(batch, MAX_GRAD_NORM, p).summed  # warm-up
    for _ in range(repeats):
        for p in configs:
            t = time.perf_counter()
            psg.clipped_sum(batch, MAX_GRAD_NORM, p)
            times[p].append(time.perf_counter() - t)
    whole = statistics.median(times[None])
    print(f"time per logical step of {n} examples, median of {repeats} interleaved rounds:")
    print(f"{'physical':>9} {'median s':>9} {'range s':>13} {'÷ whole':>8} {'max |sum diff|':>15}")
    for p in configs:
        med = statistics.median(times[p])
        diff = (sums[p] - sums[None]).abs().max().item()
        rng = f"{min(times[p]):.3f}-{max(times[p]):.3f}"
        print(f"{p or f'{n} (whole)':>9} {med:>9.3f} {rng:>13} {med / whole:>8.2f} {diff:>15.2e}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        hidden, logical, physical = (int(a) for a in sys.argv[2:])
        child(hidden, logical, physical or None)
        return
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--logical", type=int, default=4096)
    p.add_argument("--physical", type=int, default=64)
    p.add_argument("--speed-batch", type=int, default=1024)
    p.add_argument("--speed-physical", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.logical, args.speed_batch = 1024, 256
        args.speed_physical, args.repeats = [64, 128], 3
    dim = build(args.hidden, 1)[0].dim
    print(
        f"MLP {FEATURES}-{args.hidden}-{args.hidden}-{CLASSES} ({dim:,} params, float32), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.machine()}, {os.cpu_count()} cpus"
    )
    t = time.perf_counter()
    if not args.skip_memory:
        memory_table(args.hidden, args.logical, args.physical)
    if not args.skip_speed:
        speed_table(args.hidden, args.speed_batch, args.speed_physical, args.repeats)
    print(f"total {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
