"""Checkpoint and restore throughput against np.save / np.load of the same bytes,
incremental against full checkpoint bytes, and step time with an async checkpoint in
flight against a step without one, side by side in one run.

    python bench/checkpoint.py [--dim 1048576] [--bands 32] [--every 4] [--rounds 5] [--dir DIR]
        [--clipping ghost] [--batch-size 16]

At GB scale (#31 item 6): `--dim 42000000 --bands 8 --every 4 --rounds 3 --clipping
ghost --batch-size 4` (a 1.35 GB full checkpoint; ghost clipping keeps the step's own
memory near one model). The full checkpoint and its trainer are freed before the
incremental part builds its own, so the peak holds one trainer, one snapshot and one
restored copy.

Both sides fsync (a checkpoint that is not durable is not a checkpoint). Ours and the
baseline alternate round by round and the medians are compared, because this disk's
write speed drifts by 2-3x within a minute. Restore is measured hot (page cache) and,
where /proc/sys/vm/drop_caches is writable, cold; ours verifies every chunk's crc32c
and every array's checksum, np.load verifies nothing, so "np.load + crc32c" is printed
as the equally safe baseline too.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import crc32c
import numpy as np

from cocoon_ckpt import DPConfig, JobConfig
from cocoon_ckpt.train.checkpoint import Checkpointer, take_snapshot
from cocoon_ckpt.train.job_records import REQUIRED, job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store, local_backend
from state.paths import version_prefix

PACED = local_backend.PACE_BYTES


def np_save_all(folder: str, arrays: dict[str, np.ndarray]) -> None:
    os.makedirs(folder)
    for i, a in enumerate(arrays.values()):
        with open(os.path.join(folder, f"{i}.npy"), "wb") as f:
            np.save(f, a)
            f.flush()
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def np_load_all(folder: str, verify: bool) -> list[np.ndarray]:
    # Keeps every array, as a restore must: discarding each one lets malloc hand the
    # same hot pages to the next np.load, which measures memcpy, not a restore.
    out = []
    for name in sorted(os.listdir(folder)):
        a = np.load(os.path.join(folder, name))
        if verify:
            crc32c.crc32c(a.reshape(-1).view(np.uint8).data)
        out.append(a)
    return out


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], object], before: Callable[[], object] | None = None) -> float:
    if before is not None:
        before()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 20, help="approximate model parameters")
    p.add_argument("--bands", type=int, default=32)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--clipping", default="vmap", help="DPConfig.clipping (vmap, ghost)")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: str) -> None:
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    cfg = JobConfig(
        job="example:mlp",
        dp=DPConfig(
            steps=3 * args.bands,
            batch_size=args.batch_size,
            dataset_size=4096,
            noise_multiplier=1.0,
            bands=args.bands,
            clipping=args.clipping,
        ),
        options={"hidden": max(1, args.dim // 25)},
    )
    full_and_restore(args, root, cfg)
    incremental(args, root, cfg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB; load average at end: {os.getloadavg()[0]:.1f}")


def full_and_restore(args: argparse.Namespace, root: str, cfg: JobConfig) -> None:
    trainer = build_trainer(cfg, bytes(32))
    for _ in range(args.bands + 1):
        trainer.train_step()
    snap = take_snapshot(trainer, None, {})
    dim = trainer.dim
    del trainer  # the snapshot is what is written and compared
    nbytes = snap.nbytes
    print(
        f"model dim {dim}, bands {args.bands}: full checkpoint {nbytes / 2**20:.1f} MiB "
        f"in {len(snap.arrays)} arrays"
    )

    # full checkpoint vs np.save, alternating -------------------------------------
    # A job creates its store and takes its lease once, not at every checkpoint: the
    # checkpoint is timed from begin to commit, and the ratio with the store's creation
    # counted in (what this bench printed before 2026-12-04) is printed beside it.
    def ours_save(i: int) -> float:
        t = time.perf_counter()
        store = Store.open(os.path.join(root, f"s{i}.zarr"))
        store.acquire_lease()
        opened = time.perf_counter() - t
        txn = store.begin(snap.step)
        for k, a in snap.arrays.items():
            txn.put_array(k, a)
        txn.commit()
        return opened

    # The paced writer (local_backend.PACE_BYTES, the default) and the same writer
    # writing each file in one go (PACE_BYTES = 0, what it did before 2026-12-05) take
    # turns with np.save in every round.
    t_ours, t_open, t_np = [], [], []
    t_go: list[float] = []
    for i in range(args.rounds):
        for pace, into in ((PACED, t_ours), (0, t_go)):
            local_backend.PACE_BYTES = pace
            t = time.perf_counter()
            opened = ours_save(2 * i + (pace == 0))
            into.append(time.perf_counter() - t - opened)
            if pace:
                t_open.append(opened)
        t_np.append(timed(lambda i=i: np_save_all(os.path.join(root, f"n{i}"), snap.arrays)))  # type: ignore[misc]
    local_backend.PACE_BYTES = PACED
    mo, mn, mg = statistics.median(t_ours), statistics.median(t_np), statistics.median(t_go)
    with_open = statistics.median(o + c for o, c in zip(t_open, t_ours, strict=True))
    print(
        f"checkpoint: ours {nbytes / mo / 1e6:.0f} MB/s, np.save+fsync {nbytes / mn / 1e6:.0f} "
        f"MB/s, ratio {mn / mo:.2f} (median of {args.rounds} alternating rounds; with the "
        f"store's creation and lease: {mn / with_open:.2f}); each file in one go "
        f"{nbytes / mg / 1e6:.0f} MB/s, ratio {mn / mg:.2f}"
    )

    # restore ---------------------------------------------------------------------
    def ours_load() -> None:
        Store.open(os.path.join(root, "s0.zarr"), create=False).latest()  # verifies all

    base = os.path.join(root, "n0")
    for label, before in (("hot", None), ("cold", drop_caches)):
        if before is not None and not drop_caches():
            print("restore cold: /proc/sys/vm/drop_caches not writable, skipped")
            continue
        ours_load()  # warm both for the hot case
        np_load_all(base, False)
        lo, ln, lv = [], [], []
        for _ in range(args.rounds):
            lo.append(timed(ours_load, before))
            ln.append(timed(lambda: np_load_all(base, False), before))
            lv.append(timed(lambda: np_load_all(base, True), before))
        a, b, c = (statistics.median(x) for x in (lo, ln, lv))
        print(
            f"restore {label}: ours {nbytes / a / 1e6:.0f} MB/s (verified), np.load "
            f"{nbytes / b / 1e6:.0f} MB/s, ratio {b / a:.2f}; np.load+crc32c "
            f"{nbytes / c / 1e6:.0f} MB/s, ratio {c / a:.2f}"
        )


def incremental(args: argparse.Namespace, root: str, cfg: JobConfig) -> None:
    """Incremental vs full bytes, and step time with an async checkpoint in flight."""
    store = Store.open(os.path.join(root, "inc.zarr"))
    store.acquire_lease()
    ck = Checkpointer(store, async_write=True, keep_last=3)
    plain: list[float] = []
    inflight: dict[int, list[float]] = {PACED: [], 0: []}
    snaps: list[float] = []
    pace = PACED
    fresh = build_trainer(cfg, bytes(32))
    records: dict[str, object] = dict(job_records(cfg, fresh, bytes(32), None))
    if "metrics" in REQUIRED and "metrics" not in records:  # a release that stores metrics
        from cocoon_ckpt.format.metrics import TrainingMetrics

        records["metrics"] = TrainingMetrics().to_record(0)
    for _ in range(2 * args.bands):
        busy = ck.in_flight
        dt = timed(fresh.train_step)
        if fresh.step_index > 1:  # the first step's start-up is neither
            (inflight[pace] if busy else plain).append(dt)
        if fresh.step_index % args.every == 0:
            ck.wait()  # the previous write is not the snapshot's cost
            # checkpoints take turns: paced writer, then each file in one go
            pace = 0 if pace else PACED
            local_backend.PACE_BYTES = pace
            # what the training thread pays: the snapshot; the write runs off it
            snaps.append(timed(lambda: ck.save(fresh, dict(records))))
    ck.close()
    inc = ck.last
    if inc is None:
        raise SystemExit("no checkpoint was taken; use --bands >= 2 and --every < 2 * bands")
    inc_bytes = sum(
        a.nbytes for a in inc.arrays.values() if a.path.startswith(version_prefix(inc.version))
    )
    hist = (args.bands - 1) * fresh.dim * 4
    full = sum(a.nbytes for a in inc.arrays.values())  # what a full version holds
    bound = (args.every / (args.bands - 1)) * hist + (inc_bytes - args.every * fresh.dim * 4)
    print(
        f"incremental (k={args.every}, b-1={args.bands - 1}): {inc_bytes / 2**20:.1f} MiB vs "
        f"full {full / 2**20:.1f} MiB, ratio {inc_bytes / full:.3f}; k/(b-1) of history + "
        f"model = {bound / 2**20:.1f} MiB, ours / that = {inc_bytes / bound:.3f}"
    )
    files = [p for p in store.backend.sizes("") if p.startswith(version_prefix(inc.version))]
    print(
        f"per incremental version: {len(files)} files (chunks and zarr.json); snapshot on the training "
        f"thread {np.median(snaps) * 1e3:.1f} ms median ({len(snaps)} checkpoints)"
    )
    local_backend.PACE_BYTES = PACED
    for mode, label in ((PACED, "paced writer"), (0, "each file in one go")):
        if inflight[mode] and plain:
            steps = inflight[mode]
            print(
                f"step time, {label}: {np.median(steps) * 1e3:.1f} ms with a checkpoint in "
                f"flight ({len(steps)} steps), {np.median(plain) * 1e3:.1f} ms without "
                f"({len(plain)} steps), ratio {np.median(steps) / np.median(plain):.2f}"
            )


if __name__ == "__main__":
    main()
