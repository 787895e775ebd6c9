"""Checkpoint and restore throughput against np.save / np.load of the same bytes,
incremental against full checkpoint bytes, and step time with an async checkpoint in
flight against a step without one, side by side in one run.

    python bench/checkpoint.py [--dim 1048576] [--bands 32] [--every 4] [--rounds 5] [--dir DIR]
        [--clipping ghost] [--batch-size 16] [--restore-only] [--pairs 6]

At GB scale (#31 item 6): `--dim 42000000 --bands 8 --every 4 --rounds 3 --clipping
ghost --batch-size 4` (a 1.35 GB full checkpoint; ghost clipping keeps the step's own
memory near one model). The full checkpoint and its trainer are freed before the
incremental part builds its own, so the peak holds one trainer, one snapshot and one
restored copy.

Both sides fsync (a checkpoint that is not durable is not a checkpoint). Ours and the
baseline alternate round by round and the medians are compared, because this disk's
write speed drifts by 2-3x within a minute. A restore reads every array into memory
(ours as a resume does: `latest()` verifying every array, then each array in hand), in
three settings: right after the writes (each store and folder read once, as its
writer left it: the paced writer drops what it wrote from the page cache, np.save does
not), hot and, where /proc/sys/vm/drop_caches is writable, cold. Hot is `--pairs`
alternating pairs (#31: a target is met when the median of >= 6 alternating pairs is at
or below it) against np.load, then against np.load + crc32c and against ours reading
twice what is past `state.version.KEEP_BYTES` (as a resume did before it held that for one
read), each read right after the same memory was touched and freed
(`prime_memory`), each pair's ratio printed and their median; then again with memory
malloc keeps (`keep_freed_memory`), where the read path's own cost shows. The share of each side's files in the page cache is printed before
every timed read, and the CPU time beside every rate. Ours verifies every chunk's
crc32c and every array's checksum, np.load verifies nothing, so "np.load + crc32c" is
printed as the equally safe baseline too. `--restore-only` skips the incremental and
in-flight part.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
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
from cocoon_ckpt.format.snapshot import Snapshot
from cocoon_ckpt.train.checkpoint import Checkpointer, take_snapshot
from cocoon_ckpt.train.job_records import REQUIRED, job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store, file_writes
from state import version as state_version
from state.paths import version_prefix

PACED = file_writes.PACE_BYTES


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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
_libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident(folder: str) -> float:
    """The fraction of the bytes of the files under `folder` in the page cache (mincore
    over a read-only mapping of each, which faults nothing in).

    Printed before every timed read, because on this VM "hot" is not a given: other
    jobs' writes and `drop_caches` evict files between a warm-up and the timed read.
    What the page cache does not explain is fresh memory: the VM reports free 2 MiB
    blocks to its host (virtio-balloon free page reporting, order 9), so an array's
    memory, once freed and reported, faults in from the host again at 0.03-1.4 GB/s;
    the CPU time printed beside each rate shows it (page faults count as system time).
    """
    res = total = 0
    page = mmap.PAGESIZE
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    continue
                addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    continue
                try:
                    vec = ctypes.create_string_buffer((size + page - 1) // page)
                    if _libc.mincore(addr, size, vec) == 0:
                        res += int((np.frombuffer(vec.raw, np.uint8) & 1).sum()) * page
                        total += size
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
    return min(1.0, res / total) if total else 1.0


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--dim", type=int, default=1 << 20, help="approximate model parameters")
    p.add_argument("--bands", type=int, default=32)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pairs", type=int, default=6, help="alternating pairs of hot restores")
    p.add_argument("--dir", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--clipping", default="vmap", help="DPConfig.clipping (vmap, ghost)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--restore-only", action="store_true", help="skip the incremental and in-flight part"
    )
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
    if not args.restore_only:
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
    def ours_save(i: int, snap: Snapshot) -> float:
        t = time.perf_counter()
        store = Store.open(os.path.join(root, f"s{i}.zarr"))
        store.acquire_lease()
        opened = time.perf_counter() - t
        txn = store.begin(snap.step)
        for k, a in snap.arrays.items():
            txn.put_array(k, a)
        txn.commit()
        return opened

    # The paced writer (file_writes.PACE_BYTES, the default) and the same writer
    # writing each file in one go (PACE_BYTES = 0, what it did before 2026-12-05) take
    # turns with np.save in every round.
    t_ours: list[float] = []
    t_open: list[float] = []
    t_np: list[float] = []
    t_go: list[float] = []
    for i in range(args.rounds):
        for pace, into in ((PACED, t_ours), (0, t_go)):
            file_writes.PACE_BYTES = pace
            t = time.perf_counter()
            opened = ours_save(2 * i + (pace == 0), snap)
            into.append(time.perf_counter() - t - opened)
            if pace:
                t_open.append(opened)
        folder = os.path.join(root, f"n{i}")
        t_np.append(timed(lambda f=folder, a=snap.arrays: np_save_all(f, a)))  # type: ignore[misc]
    file_writes.PACE_BYTES = PACED
    mo, mn, mg = statistics.median(t_ours), statistics.median(t_np), statistics.median(t_go)
    with_open = statistics.median(o + c for o, c in zip(t_open, t_ours, strict=True))
    print(
        f"checkpoint: ours {nbytes / mo / 1e6:.0f} MB/s, np.save+fsync {nbytes / mn / 1e6:.0f} "
        f"MB/s, ratio {mn / mo:.2f} (median of {args.rounds} alternating rounds; with the "
        f"store's creation and lease: {mn / with_open:.2f}); each file in one go "
        f"{nbytes / mg / 1e6:.0f} MB/s, ratio {mn / mg:.2f}"
    )

    # restore ---------------------------------------------------------------------
    # Ours is read as a resume reads it (`train.start`): every array verified and in
    # hand, as np.load's are. Each timed read is preceded by the share of its files in
    # the page cache (`resident`): the paced writer drops what it wrote from the page
    # cache, np.save leaves it there, so a read right after the writes compares a
    # partly cold read with a hot one. Hot compares both after a warm-up read that
    # leaves both in the cache (`hot_pairs`), cold both after the caches are dropped.
    # A version past `state.version.KEEP_BYTES` (1 GiB) holds the rest for one read where
    # memory allows (`SPARE_SHARE`); "read twice past KEEP_BYTES" has no memory to spare,
    # its last arrays verified by a streamed pass and read again when asked for (what a
    # resume did before).
    del snap  # only its size is needed from here: 1.28 GB less at 42M

    spare = state_version.SPARE_SHARE

    def ours_load(path: str, side: str) -> list[np.ndarray]:
        # no memory to spare: what a resume did before 2026-12-05 (read twice)
        state_version.SPARE_SHARE = 1 << 62 if "twice" in side else spare
        try:
            version = Store.open(path, create=False).latest(stream=lambda _name: False)
            if version is None:
                raise SystemExit(f"{path}: no version")
            return [version.array(n) for n in version.array_names()]
        finally:
            state_version.SPARE_SHARE = spare

    Runs = dict[str, tuple[list[float], list[float], list[float]]]

    def report(label: str, runs: Runs) -> None:
        for side, (res, secs, cpu) in runs.items():
            print(
                f"restore {label}, {side}: in the page cache before each read "
                + ", ".join(f"{r:.2f}" for r in res)
                + "; GB/s "
                + ", ".join(f"{nbytes / x / 1e9:.2f}" for x in secs)
                + "; CPU s "
                + ", ".join(f"{x:.2f}" for x in cpu)
            )
        wall = {side: statistics.median(secs) for side, (_r, secs, _c) in runs.items()}
        used = {side: statistics.median(c) for side, (_r, _s, c) in runs.items()}
        ours = "ours (paced)"
        print(
            f"restore {label}: ours {nbytes / wall[ours] / 1e6:.0f} MB/s (verified); ours ÷ "
            + "; ".join(
                f"{side} {wall[side] / wall[ours]:.2f} (CPU {used[side] / used[ours]:.2f})"
                for side in runs
                if side != ours
            )
        )

    def sample(runs: Runs, side: str, path: str) -> None:
        res, secs, cpu = runs.setdefault(side, ([], [], []))
        res.append(resident(path))
        if side.startswith("ours"):
            fn: Callable[[], object] = lambda: ours_load(path, side)  # noqa: E731
        else:
            fn = lambda: np_load_all(path, side.endswith("crc32c"))  # noqa: E731
        used = time.process_time()
        secs.append(timed(fn))
        cpu.append(time.process_time() - used)

    after: Runs = {side: ([], [], []) for side in ("ours (paced)", "ours (written in one go)")}
    after["np.load"] = ([], [], [])
    for i in range(args.rounds):  # each store and folder read once, as its writer left it
        written = [f"s{2 * i}.zarr", f"s{2 * i + 1}.zarr", f"n{i}"]
        turns = list(zip(after, written, strict=True))
        for side, name in turns[i % 3 :] + turns[: i % 3]:  # taking turns at going first
            sample(after, side, os.path.join(root, name))
    report("right after the writes", after)
    ours_path, np_path = os.path.join(root, "s0.zarr"), os.path.join(root, "n0")

    def warm(side: str, path: str) -> None:
        if side.startswith("ours"):
            ours_load(path, side)
        else:
            np_load_all(path, False)

    # hot: alternating pairs, the figure #31 asks for (the median of >= 6 pairs)
    ours_load(ours_path, "ours")  # a warm-up read of both
    np_load_all(np_path, False)
    rivals = ("np.load", "np.load + crc32c", "ours, read twice past KEEP_BYTES")
    for memory in ("as the VM gives it", "kept by malloc"):
        if memory == "kept by malloc":
            keep_freed_memory()
        for rival in rivals if memory == "kept by malloc" else rivals[:1]:
            path = ours_path if rival.startswith("ours") else np_path
            print(f"restore hot, memory {memory}:")
            hot_pairs(args.pairs, ("ours (paced)", ours_path), (rival, path), sample, warm, nbytes)
    if not drop_caches():
        print("restore cold: /proc/sys/vm/drop_caches not writable, skipped")
        return
    paths = {
        "ours (paced)": ours_path,
        "ours, read twice past KEEP_BYTES": ours_path,
        "np.load": np_path,
        "np.load + crc32c": np_path,
    }
    runs: Runs = {side: ([], [], []) for side in paths}
    order = list(paths.items())
    for r in range(args.rounds):
        # the sides take turns at going first: a side reading right after another freed
        # its arrays finds warmer memory (see resident's note)
        for side, path in order[r % len(order) :] + order[: r % len(order)]:
            drop_caches()
            sample(runs, side, path)
    report("cold", runs)


def keep_freed_memory() -> None:
    """From here on malloc serves every allocation from its heap and keeps what is freed
    (glibc: no mmap, no trim), so each read finds memory this process has touched
    before: what the read path itself costs, without the VM's fresh memory (`resident`'s
    note) deciding a pair."""
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def prime_memory(nbytes: int) -> None:
    """Touch and free `nbytes` of memory, so that the read timed next finds memory the
    kernel has just taken back and not yet reported to the host (see `resident`'s note):
    both sides of a pair start from the same memory, whoever read last."""
    block = np.ones(nbytes, dtype=np.uint8)
    del block


def hot_pairs(
    pairs: int,
    ours: tuple[str, str],
    rival: tuple[str, str],
    sample: Callable[[dict[str, tuple[list[float], list[float], list[float]]], str, str], None],
    warm: Callable[[str, str], None],
    nbytes: int,
) -> None:
    """`pairs` hot restores of `ours` and of `rival` ((side, path) each), the two in an
    order that alternates pair by pair, each read preceded by `prime_memory` (and by a
    `warm` read of its files if another job evicted some); prints every pair's ratio of
    speeds, wall and CPU (rival's time ÷ ours: above 1, ours is faster), and their
    medians."""
    runs: dict[str, tuple[list[float], list[float], list[float]]] = {}
    walls, cpus = [], []
    for i in range(pairs):
        for side, path in (ours, rival) if i % 2 == 0 else (rival, ours):
            if resident(path) < 0.99:  # other jobs evict pages between reads
                warm(side, path)
            prime_memory(nbytes)
            sample(runs, side, path)
        (res_o, sec_o, cpu_o), (res_r, sec_r, cpu_r) = runs[ours[0]], runs[rival[0]]
        walls.append(sec_r[-1] / sec_o[-1])
        cpus.append(cpu_r[-1] / cpu_o[-1])
        print(
            f"restore hot, pair {i} ({'ours' if i % 2 == 0 else rival[0]} first): ours "
            f"{nbytes / sec_o[-1] / 1e9:.2f} GB/s (CPU {cpu_o[-1]:.2f} s, cached "
            f"{res_o[-1]:.2f}), {rival[0]} {nbytes / sec_r[-1] / 1e9:.2f} GB/s (CPU "
            f"{cpu_r[-1]:.2f} s, cached {res_r[-1]:.2f}): ours ÷ {rival[0]} {walls[-1]:.2f} "
            f"(CPU {cpus[-1]:.2f})"
        )
    print(
        f"restore hot: ours ÷ {rival[0]} (speed), median of {pairs} alternating pairs: "
        f"{statistics.median(walls):.2f} (CPU {statistics.median(cpus):.2f}); pairs "
        + ", ".join(f"{w:.2f}" for w in walls)
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
            file_writes.PACE_BYTES = pace
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
    file_writes.PACE_BYTES = PACED
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
