"""What checkpointing often costs a whole job: `train` checkpointing every `--every`
steps against checkpointing once (at the end), whole processes, in alternating pairs.

    python bench/cadence.py [--jobs mlp digits] [--pairs 6] [--every 10]

Jobs (#16's two: the target is <= 1.3x the wall time for both):
- `mlp`: `train --example mlp --steps 300` (the built-in example).
- `digits`: `train --job examples.digits.run:build --steps 1500 --batch-size 20
  --dataset-size 1437 --lr 0.5 --bands 4` (a digits-sized MLP, 1.7-3 ms a step here,
  so every 10 steps is a checkpoint every ~20-30 ms of training). Needs scikit-learn
  (`pip install -e ".[examples]"`).

Each pair runs the two cadences in turn (the order alternates), each in a fresh store
with one shared key file, `--no-progress`; the ratio is taken pair by pair, so a drift
in the machine's speed cancels. Prints per job the wall ratio's median and range, the
cpu ratio (user + system of the child), the median seconds of each cadence and the
files a version writes (its folder's files and its manifest, counted in the newest
version of the last frequent run). #31's target: the median of >= 6 pairs <= 1.3x.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

JOBS = {
    "mlp": (["--example", "mlp"], 300),
    "digits": (
        ["--job", "examples.digits.run:build", "--batch-size", "20", "--dataset-size", "1437",
         "--lr", "0.5", "--bands", "4"],
        1500,
    ),
}  # fmt: skip


def _run(args: list[str], steps: int, every: int, store: str, key: str) -> tuple[float, float]:
    """(wall s, cpu s) of one whole `train` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "train", *args, "--steps", str(steps),
         "--checkpoint-every", str(every), "--store", store, "--key-file", key,
         "--no-progress"],
        check=True, stdout=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))),
    )  # fmt: skip
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def files_per_version(store: str) -> int:
    """The files the newest version of `store` wrote: those in its folder under
    versions/ (its arrays' chunks and zarr.json, its groups' zarr.json) and its manifest."""
    versions = os.path.join(store, "versions")
    newest = max(d for d in os.listdir(versions) if d != "zarr.json")
    return 1 + sum(len(files) for _, _, files in os.walk(os.path.join(versions, newest)))


def compare(name: str, pairs: int, every: int, steps: int | None = None) -> str:
    """One job's line: `pairs` alternating pairs of every `every` steps against once
    (`steps` overrides the job's step count)."""
    args, default_steps = JOBS[name]
    steps = default_steps if steps is None else steps
    walls: dict[int, list[float]] = {every: [], steps: []}
    files = 0
    cpus: dict[int, list[float]] = {every: [], steps: []}
    with tempfile.TemporaryDirectory() as tmp:
        key = os.path.join(tmp, "key")
        _run(args, steps, steps, os.path.join(tmp, "warm.zarr"), key)  # warm caches
        for i in range(pairs):
            for cadence in (every, steps) if i % 2 == 0 else (steps, every):
                store = os.path.join(tmp, f"{i}-{cadence}.zarr")
                wall, cpu = _run(args, steps, cadence, store, key)
                walls[cadence].append(wall)
                cpus[cadence].append(cpu)
                if cadence == every:
                    files = files_per_version(store)
    ratios = [x / y for x, y in zip(walls[every], walls[steps], strict=True)]
    cpu_ratios = [x / y for x, y in zip(cpus[every], cpus[steps], strict=True)]
    return (
        f"{name}: {steps} steps, every {every} / once, {pairs} pairs: wall "
        f"{statistics.median(ratios):.2f}x median ({min(ratios):.2f}-{max(ratios):.2f}); "
        f"cpu {statistics.median(cpu_ratios):.2f}x; "
        f"{statistics.median(walls[every]):.1f} s vs {statistics.median(walls[steps]):.1f} s; "
        f"{files} files a version"
    )


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS))
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args()
    for name in a.jobs:
        print(compare(name, a.pairs, a.every), flush=True)


if __name__ == "__main__":
    main()
