"""Checkpoint and restore throughput against np.save / np.load of the same bytes,
incremental against full checkpoint bytes, and step time with an async checkpoint in
flight against a step without one, side by side in one run.

    python bench/checkpoint.py [--dim 1048576] [--bands 32] [--every 4] [--dir DIR]

Both sides fsync (a checkpoint that is not durable is not a checkpoint); the no-fsync
np.save figure is printed too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.checkpoint import Checkpointer, take_snapshot
from cocoon_ckpt.job import build_trainer
from state import Store


def np_save_all(folder: str, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    os.makedirs(folder)
    for i, a in enumerate(arrays.values()):
        path = os.path.join(folder, f"{i}.npy")
        with open(path, "wb") as f:
            np.save(f, a)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 20, help="approximate model parameters")
    p.add_argument("--bands", type=int, default=32)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    hidden = max(1, args.dim // 25)
    steps = 3 * args.bands
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=steps, batch_size=16, dataset_size=4096, noise_multiplier=1.0, bands=args.bands
        ),
        options={"hidden": hidden},
    )
    trainer = build_trainer(cfg, bytes(32))
    for _ in range(args.bands + 1):
        trainer.train_step()
    snap = take_snapshot(trainer, None, {})
    nbytes = snap.nbytes
    print(
        f"model dim {trainer.dim}, bands {args.bands}: full checkpoint {nbytes / 2**20:.1f} MiB "
        f"in {len(snap.arrays)} arrays"
    )

    # full checkpoint vs np.save -------------------------------------------------
    def ours_save(i: int) -> float:
        store = Store.open(os.path.join(root, f"s{i}.zarr"))
        store.acquire_lease()
        t = time.perf_counter()
        txn = store.begin(snap.step)
        for k, a in snap.arrays.items():
            txn.put_array(k, a)
        txn.commit()
        return time.perf_counter() - t

    def base_save(i: int, fsync: bool = True) -> float:
        t = time.perf_counter()
        np_save_all(os.path.join(root, f"n{i}-{fsync}"), snap.arrays, fsync)
        return time.perf_counter() - t

    t_ours = min(ours_save(i) for i in range(3))
    t_np = min(base_save(i) for i in range(3))
    t_np_nofsync = min(base_save(i + 10, fsync=False) for i in range(3))
    print(
        f"checkpoint: ours {nbytes / t_ours / 1e6:.0f} MB/s, np.save+fsync "
        f"{nbytes / t_np / 1e6:.0f} MB/s, ratio {t_np / t_ours:.2f} "
        f"(np.save without fsync {nbytes / t_np_nofsync / 1e6:.0f} MB/s, ratio "
        f"{t_np_nofsync / t_ours:.2f})"
    )

    def ours_load() -> float:
        store = Store.open(os.path.join(root, "s0.zarr"), create=False)
        t = time.perf_counter()
        store.latest()  # reads and verifies every array (crc32c per chunk and per array)
        return time.perf_counter() - t

    def base_load() -> float:
        folder = os.path.join(root, "n0-True")
        t = time.perf_counter()
        for name in sorted(os.listdir(folder)):
            np.load(os.path.join(folder, name))
        return time.perf_counter() - t

    t_lo = min(ours_load() for _ in range(3))
    t_ln = min(base_load() for _ in range(3))
    print(
        f"restore: ours {nbytes / t_lo / 1e6:.0f} MB/s (verified), np.load "
        f"{nbytes / t_ln / 1e6:.0f} MB/s, ratio {t_ln / t_lo:.2f}"
    )

    # incremental vs full, and async step time -----------------------------------
    store = Store.open(os.path.join(root, "inc.zarr"))
    store.acquire_lease()
    ck = Checkpointer(store, async_write=True, keep_last=3)
    plain, inflight = [], []
    fresh = build_trainer(cfg, bytes(32))
    full_bytes = nbytes  # a full checkpoint of a filled ring, measured above
    for _ in range(2 * args.bands):
        busy = ck.in_flight
        t = time.perf_counter()
        fresh.train_step()
        dt = time.perf_counter() - t
        (inflight if busy else plain).append(dt)
        if fresh.step_index % args.every == 0:
            ck.save(fresh, {})
    ck.wait()
    inc = ck.last
    if inc is None:
        raise SystemExit("no checkpoint was taken; use --bands >= 2 and --every < 2 * bands")
    inc_bytes = sum(
        a.nbytes for a in inc.arrays.values() if a.path.startswith(f"versions/{inc.version:08d}-")
    )
    hist = (args.bands - 1) * fresh.dim * 4
    other = inc_bytes - args.every * fresh.dim * 4
    bound = (args.every / (args.bands - 1)) * hist + other
    print(
        f"incremental (k={args.every}, b-1={args.bands - 1}): {inc_bytes / 2**20:.1f} MiB vs "
        f"full {full_bytes / 2**20:.1f} MiB, ratio {inc_bytes / full_bytes:.3f}; "
        f"k/(b-1) of history + model = {bound / 2**20:.1f} MiB, ours / that = {inc_bytes / bound:.3f}"
    )
    if inflight:
        print(
            f"step time: {np.median(inflight) * 1e3:.1f} ms with a checkpoint in flight "
            f"({len(inflight)} steps), {np.median(plain) * 1e3:.1f} ms without "
            f"({len(plain)} steps), ratio {np.median(inflight) / np.median(plain):.2f}"
        )
    ck.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
