"""Writing versions: a snapshot of the trainer's state, written and committed.

A snapshot copies the trainer's `state_dict()` into host memory through the codec
(`cocoon_ckpt.format.codec`: only the ring slots new since the parent version are
copied); a background thread writes it and commits. At most one
checkpoint is in flight, so memory stays bounded by one snapshot.

Two things run beside the writer, off the training loop's path: the version's epsilon
(composed while the arrays are written; the recorded value is the same) and, on a
local store, the retention after each commit, which the next commit waits for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from cocoon_ckpt.dp.accounting.accountant import Accountant
from cocoon_ckpt.format.codec import encode
from cocoon_ckpt.format.snapshot import (
    BUFFERS,
    LENT_ROW_WAIT_S,
    LentRowPolicy,
    SharedRows,
    Snapshot,
)
from cocoon_ckpt.records import NoiseRecord, RankShard
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.job_records import check_job_records
from cocoon_ckpt.train.trainer import DPTrainer
from state import (
    CorruptVersionError,
    FormatVersionError,
    Manifest,
    Store,
    Transaction,
    hooks,
)
from state.threads import submit_or_run

__all__ = ["Checkpointer", "Snapshot", "take_snapshot"]

log = logging.getLogger(__name__)

ASYNC_FLUSH = hooks.declare(
    "checkpoint.async_flush", "in the background writer, before it starts a version"
)


def take_snapshot(
    trainer: DPTrainer, parent: Manifest | None, extra_records: Mapping[str, Any]
) -> Snapshot:
    """Copy the trainer's state (`state_dict()`, encoded by the codec) with the runner's
    records; ring slots the parent already holds are referenced.

    In a multi-process job every rank snapshots its own ring shard; only the
    coordinator snapshots the rest (parameters are the same on every rank). The
    generators' states are packed into their record (`format.packed`): a version of a
    small model is five files fewer."""
    shard_only = trainer.dist is not None and not trainer.dist.is_coordinator
    snap = encode(trainer.state_dict(), parent, shard_only=shard_only, packed=True)
    if not shard_only:
        snap.records.update(extra_records)
    return snap


def _lower_priority() -> None:
    """Run this thread at nice 10 (Linux threads have their own nice), so the training
    threads keep the cores; what is computed is unaffected."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _idle_priority() -> None:
    """`_lower_priority`, then SCHED_IDLE where the system has one (Linux: this thread
    gets a core only when no other thread wants it, and never preempts one); what is
    computed is unaffected."""
    _lower_priority()
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


#: A large version's writer runs at SCHED_IDLE (`_idle_priority`) when True, at nice 10
#: when False (the default: `_background` says why).
BULK_IDLE = False


#: The interpreter's thread switch interval while a job writes in the background.
WRITER_SWITCH_INTERVAL = 0.0005


@contextlib.contextmanager
def writer_handoff() -> Iterator[None]:
    """Shorten the interpreter's thread switch interval (5 ms by default) to 0.5 ms, and
    put it back after, unless it was already shorter or was changed meanwhile.

    The background writer makes ~100 syscalls a version, and after each it waits for
    the GIL, which the training thread holds between its torch ops: at 5 ms the writer
    of the digits-sized job (a checkpoint every 17 ms of training) fell behind and the
    loop blocked in `save`. Measured whole-process: 0.93x the wall time of that job at
    0.5 ms (0.90-0.95, 4 pairs), the job without checkpoints 1.04x (0.99-1.09, noise).
    Only timing changes; no result does."""
    before = sys.getswitchinterval()
    if before <= WRITER_SWITCH_INTERVAL:
        yield
        return
    sys.setswitchinterval(WRITER_SWITCH_INTERVAL)
    ours = sys.getswitchinterval()  # as the interpreter stores it (in microseconds)
    try:
        yield
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(before)


#: A version of at least this many new bytes is written by the lowered writer thread.
BULK_BYTES = 32 << 20


def _background(
    name: str, *, lowered: bool, idle: bool = False
) -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread named `name`, at nice 10 if `lowered`, at SCHED_IDLE if `idle`.

    The writer and retention are not lowered: their work is ~100 short syscalls a
    version, and at nice 10 each wake-up waited behind the training threads, so the
    writer fell behind a checkpoint every 10 steps of the digits-sized job (whole
    process 0.95x the wall time without the nice, 3 pairs; the mlp example 0.99x, 5
    pairs). The epsilon is CPU work (FFTs) and stays lowered.

    A large version's writer is lowered (`BULK_BYTES`): its work is copying hundreds of
    MB into the page cache and waiting on the disk, and at nice 0 on 2 cores it took a
    core from the training threads: the step after an asynchronous checkpoint of an
    8M-parameter job (160 MB a version) was 1.83x a step after none, 1.19x with the
    writer at nice 10 (4 alternating rounds, load 8, `bench/stall.py`), and the write
    took no longer (3.9 s against 4.3 s to commit).

    With the large files written by O_DIRECT (`state.file_writes.DIRECT_BYTES`) the
    writer's own work is a copy and a crc in C that release the GIL, so at SCHED_IDLE
    (`BULK_IDLE`) it no longer stalls the training thread on a GIL held without a core
    (asleep at most 32 ms), and it runs on what the training threads leave idle. At 8M,
    each pair's steps at the same batch size and the modes' order balanced, the step
    after an asynchronous checkpoint was 1.00 and 1.01x a step after none at SCHED_IDLE
    against 1.09 and 1.12x at nice 10 in the same runs (1.07, 1.13 in 2 more; medians of
    8 pairs, load 1.5-2.1; the writer's CPU in that step 25-30 ms against 60-65). Its
    cost: a thread at SCHED_IDLE gets a core only when nothing else wants one, so on a
    machine busy beyond its cores a job's next checkpoint can find the last one still
    in flight: 2 times in 24 (188 ms at most, load 5.6) against 0 in 24 at nice 10
    (`bench/stall_pairs.py`'s cadence count, docs/benchmarks.md). And on a machine
    whose cores are all taken by other processes it starves: with two busy loops at
    nice 0 beside the 8M job, the step after an asynchronous checkpoint was 2.44-4.66x
    a step after none at SCHED_IDLE, the training thread asleep 2.7-4.8 s on the writer
    (the GIL it took between C calls, a lent row it had to write next), against
    0.57-1.29x at nice 10 in the same pairs; an unprivileged thread cannot leave
    SCHED_IDLE again to finish what a step waits for. So nice 10 is the default, and
    SCHED_IDLE (`BULK_IDLE = True`) an opt-in for a machine that runs nothing else."""
    init = _idle_priority if idle else _lower_priority if lowered else None
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=init
    )


class Checkpointer:
    """Writes versions of a trainer's state to a store, optionally in the background.

    Args:
        store: an open store whose lease this process holds.
        async_write: write in a background thread while training goes on.
        keep_last: retention after each commit (>= 2).
        lent_rows: what a step does when it must overwrite a ring row lent to the version
            in flight (`format.snapshot.SharedRows`) that the writer has not written yet:
            "wait" (default): the writer writes that row next and the step waits for it,
            copying it out only if the writer has not begun it within `lent_row_wait_s`;
            or "copy" it out at once (one ring row of memory held until the version is
            written: 328 MiB at 85.9M, where in one run copying two rows took the peak
            with a write in flight to 1.28x the bound of #31 item 2 against 1.16x waiting,
            and the step to 3.94 s against 1.84, the copies' pages being fresh). The
            stored bytes are the same either way.
        lent_row_wait_s: with "wait", the longest a step waits for the writer to begin a
            lent row (`format.snapshot.LENT_ROW_WAIT_S`); None: as long as it takes.
    """

    def __init__(
        self,
        store: Store,
        *,
        async_write: bool = True,
        keep_last: int = 3,
        lent_rows: LentRowPolicy = "wait",
        lent_row_wait_s: float | None = LENT_ROW_WAIT_S,
    ) -> None:
        self.store = store
        self.async_write = async_write
        self.keep_last = keep_last
        self._pool = _background("ckpt", lowered=False)
        # Linux lets a thread raise its nice but not lower it back, so a large version
        # goes to a writer thread of its own, lowered once; at most one write is in
        # flight, so versions are still written in order.
        self._bulk = _background("ckpt-bulk", lowered=True, idle=BULK_IDLE)
        # The epsilon of a new round count is CPU work (FFTs, tens of ms) and the array
        # writes mostly wait on the disk: composed on its own thread, the two overlap.
        self._accounting = _background("ckpt-epsilon", lowered=True)
        # Deleting a retired version waits on the disk (55-170 ms a version measured on
        # this discard-mounted ext4, against ~20 ms of CPU): on a local store it runs on
        # its own thread while the loop trains and the next version is written. Other
        # backends retain inline: their wrappers (faulty://, chaos) draw faults in call
        # order, which deletions interleaved with writes would make depend on timing.
        self._background_retention = async_write and store.backend.capabilities.fsync
        self._retainer = _background("ckpt-retain", lowered=False)
        self._inflight: concurrent.futures.Future[Manifest] | None = None
        self._writing: Snapshot | None = None  # the in-flight write's, recycled after
        # the ring rows a version being written reads from the live ring, not a copy
        self._lent = SharedRows(on_overwrite=lent_rows, max_wait_s=lent_row_wait_s)
        self._retaining: concurrent.futures.Future[None] | None = None
        self.last: Manifest | None = None
        self.bytes_written = 0

    @property
    def in_flight(self) -> bool:
        """A background checkpoint is being written now."""
        return self._inflight is not None and not self._inflight.done()

    def set_parent(self, manifest: Manifest | None) -> None:
        self.last = manifest

    def save(self, trainer: DPTrainer, extra_records: Mapping[str, Any]) -> None:
        """Snapshot now; write (in the background when async) and commit.

        In a multi-process job every rank calls this at the same step; the write is in
        the foreground (its collectives must not interleave with training's)."""
        self._wait_write()  # at most one in flight: bounded memory, ordered versions
        if trainer.dist is None or trainer.dist.is_coordinator:
            # a version without the job's records would be half-readable (export,
            # inspect and audit need them): refuse before anything is written
            check_job_records(extra_records)
        with self._lent.lending():
            snap = take_snapshot(trainer, self.last, extra_records)
        self._lent.adopt(snap.arrays)
        BUFFERS.trim()
        if trainer.dist is not None or not self.async_write:
            try:
                if trainer.dist is not None:
                    self._write_coordinated(snap, trainer.dist)
                else:
                    self._write(snap)
            finally:
                self._lent.release()
            snap.recycle()
        else:
            pool = self._bulk if snap.nbytes >= BULK_BYTES else self._pool
            self._inflight = pool.submit(self._write, snap)
            self._writing = snap

    def wait(self) -> Manifest | None:
        """Block until the in-flight checkpoint is committed and its retention done;
        re-raise the error of either."""
        self._wait_write()
        self._join_retention()
        return self.last

    def close(self) -> None:
        """Wait (`wait`), then stop the background threads."""
        try:
            self.wait()
        finally:
            for pool in (self._pool, self._bulk, self._retainer, self._accounting):
                pool.shutdown(wait=True)
            BUFFERS.clear()  # the job's buffers go with it

    def _wait_write(self) -> None:
        """Block until the in-flight checkpoint is committed; re-raise its error."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            try:
                fut.result()
            finally:
                self._lent.release()  # written or failed: the ring is its own again
            if self._writing is not None:  # written: its buffers serve the next snapshot
                self._writing.recycle()
                self._writing = None

    def _join_retention(self) -> None:
        """Block until the last commit's retention is done; re-raise its error. Called
        by the writer before the next commit and by `wait` after the write: never both
        at once (at most one write is in flight)."""
        if self._retaining is not None:
            fut, self._retaining = self._retaining, None
            try:
                fut.result()
            except Exception as exc:  # raised where the next commit or wait() stops
                committed = self.last.version if self.last is not None else None
                exc.add_note(
                    f"(retention after committing version {committed} failed; nothing "
                    "after that version was committed)"
                )
                raise

    def _write_coordinated(self, snap: Snapshot, dist: DistContext) -> Manifest:
        """Every rank writes its arrays of version v (its own folder); after a barrier
        (the gather) the coordinator writes the manifest listing them all. A rank that
        dies before the gather leaves no manifest, so the previous version stays newest."""
        txn = self._begin(snap) if dist.is_coordinator else None
        head = dist.broadcast_object(
            (txn.version, txn.lease.generation) if txn is not None else None
        )
        # the coordinator's own shard is in its noise record already
        shard = None if txn is not None else snap.shard
        if txn is None:
            writer = self.store.shard_writer(head[0], snap.step, head[1], dist.rank)
            for name in list(snap.arrays):
                self._put(name, snap, writer.put_array)
            mine = {**writer.finish(), **snap.references}
            written = writer.bytes_written
            self._lent.check_checksums()  # before the shard's entries are sent
        else:
            mine, written = {}, 0
        gathered = dist.all_gather_object((mine, shard))
        manifest = None
        if txn is not None:
            noise: NoiseRecord = snap.records["noise"]
            rank_shard: RankShard
            for arrays, rank_shard in gathered[1:]:
                for name, meta in arrays.items():
                    txn.reference(name, meta)
                noise["shards"].append(
                    {
                        "start": rank_shard["start"],
                        "stop": rank_shard["stop"],
                        "slots": rank_shard["slots"],
                    }
                )
                noise["placement"] = noise.get("placement", []) + rank_shard["placement"]
            manifest = self._commit(txn, snap)
        manifest = dist.broadcast_object(manifest)
        self.bytes_written += written
        self.last = manifest
        return manifest  # type: ignore[no-any-return]

    def _write(self, snap: Snapshot) -> Manifest:
        try:
            hooks.point(ASYNC_FLUSH, step=snap.step)
            return self._commit(self._begin(snap), snap)
        finally:
            # written or failed: a step waiting on a lent row (lent_rows="wait") goes on
            self._lent.writer_done()

    def _begin(self, snap: Snapshot) -> Transaction:
        """The next version, child of the last committed one."""
        parent = self.last
        return self.store.begin(
            snap.step,
            parent=parent.version if parent else None,
            job_fingerprint=snap.records.get("fingerprint"),
        )

    def _commit(self, txn: Transaction, snap: Snapshot) -> Manifest:
        """Write this process's arrays into `txn`, then the records, and commit; then
        retention (on its own thread when `_background_retention`)."""
        acc = snap.records.get("accountant")
        epsilon = None
        # Only the job's last version stores its epsilon; the others store the
        # accountant's parameters and readers (inspect, audit, export) compose it. A new
        # round count's composition is two FFT convolutions pinned by bit-identity with
        # dp-accounting, 30-85 ms of CPU on the examples, and on 2 cores the training
        # paid for it at every checkpoint of versions retention mostly deletes unread.
        if acc is not None and acc.get("epsilon") is None and snap.records.get("complete"):
            epsilon = submit_or_run(self._accounting, Accountant.from_state_dict(acc).epsilon)
        order = self._write_order(snap)
        while order:  # a lent row a step waits on goes next (lent_rows="wait")
            name = self._lent.next_array(order)
            order.remove(name)
            self._put(name, snap, txn.put_array)
        for name, meta in snap.references.items():
            txn.reference(name, meta)
        # A fresh folder per write: a crash before the commit leaves an unreferenced
        # folder (never a half-written array a retry would collide with).
        token = secrets.token_hex(4)
        for name, arr in snap.shared.items():
            txn.reference(name, self.store.put_shared(f"{token}/{name}", arr))
        if acc is not None and epsilon is not None:
            acc["epsilon"] = epsilon.result()
        self._lent.check_checksums()  # the lent rows' entries have their writer's
        for name, rec in snap.records.items():
            txn.put_record(name, rec)
        # The previous commit's retention ends before this version is visible: it never
        # sees a manifest newer than the one it runs for nor this one's temp file (which
        # it would take for a leftover), and its failure (a crash point, an I/O error)
        # stops this commit, as it did when retention ran inline.
        self._join_retention()
        manifest = txn.commit()
        self.bytes_written += txn.bytes_written
        self.last = manifest
        log.info(
            "committed version %d at step %d (%d bytes)",
            manifest.version,
            snap.step,
            txn.bytes_written,
        )
        if self._background_retention:
            self._retaining = submit_or_run(self._retainer, self._retain, manifest.version)
        else:
            self._retain(manifest.version)
        return manifest

    def _write_order(self, snap: Snapshot) -> list[str]:
        """Every array, lent ring rows first. First: each row written before the ring
        comes to its slot is a row never copied nor waited for (at 85.9M, b = 4, a write
        slower than the steps had the ring copy out two of three rows while the model's
        copy was written ahead of them). The ring overwrites its oldest slot next. When
        it copies, the newest row goes first, so the writer is the least likely to be in
        the row the ring needs (a wait) rather than not yet at it (one row copied); when
        it waits (lent_rows="wait"), the oldest goes first, the one it waits for first."""
        names = list(snap.arrays)
        rows = [n for n in names if self._lent.is_lent(n)]
        rest = [n for n in names if not self._lent.is_lent(n)]
        newest_first = self._lent.on_overwrite == "copy"
        return sorted(rows, key=self._lent.step_of, reverse=newest_first) + rest

    def _put(self, name: str, snap: Snapshot, put: Any) -> None:
        """Write array `name` of `snap` with `put`; a lent ring row is claimed first
        (the ring waits for it, or copies it out if it must overwrite it before)."""
        lent = self._lent.claim(name)
        checksum = None
        try:
            checksum = put(name, snap.arrays[name] if lent is None else lent).checksum
        finally:
            # a lent row's array is the row: its checksum is the record entry's
            self._lent.written(name, checksum)

    def _retain(self, newest: int) -> None:
        """Retention after committing version `newest`. It deletes nothing above the
        newest manifest it lists, and a version being written references only arrays
        its parent (the newest, always kept) references, so it may run while the next
        version's arrays are written."""
        try:
            self.store.retain(keep_last=self.keep_last, newest_valid=newest)
        except (CorruptVersionError, FormatVersionError) as exc:
            # The commit stands; only the clean-up is skipped, deleting nothing, until
            # the damaged version is repaired or retain(discard_damaged=True) is asked for.
            log.warning("version %d committed; retention skipped: %s", newest, exc)
