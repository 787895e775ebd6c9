"""`Snapshot`: one checkpoint in host memory, ready to be written; `Encoded`, what a
part's codec returns (its record and its arrays), which the snapshot takes in;
`host_copy`, how a part copies a live tensor into it; `BUFFERS`, the host buffers a
checkpointer's snapshots reuse; `SharedRows`, ring rows a snapshot shares with the live
ring instead of copying them (copy-on-write)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar, get_args

import numpy as np
import torch

from cocoon_ckpt.records import RankShard
from state import ArrayMeta

__all__ = [
    "BUFFERS",
    "Encoded",
    "LENT_ROW_POLICIES",
    "LENT_ROW_WAIT_S",
    "LentRowPolicy",
    "SharedRows",
    "SharingRing",
    "SnapshotBuffers",
    "Snapshot",
    "defer_row_checksum",
    "host_copy",
    "lend_row",
]

R = TypeVar("R")

#: What the ring may do before overwriting a lent row the writer has not begun
#: (`SharedRows`, `Checkpointer(lent_rows=...)`): copy it out, or wait for the writer.
LentRowPolicy = Literal["copy", "wait"]
LENT_ROW_POLICIES: tuple[LentRowPolicy, ...] = get_args(LentRowPolicy)

#: How long a `Checkpointer`'s step waits (lent_rows="wait") for the writer to begin a
#: lent row it must overwrite before it copies the row out instead (seconds). The writer
#: begins it once the array it is in is written: at most one ring row (328 MiB at
#: 85.9M parameters, 1.1-2.3 s at the 143-300 MB/s the paced writer reached here), so
#: only a disk slower than that makes a step copy; a stalled one costs a step this
#: long, not as long as the disk takes.
LENT_ROW_WAIT_S = 2.0


class SnapshotBuffers:
    """Host buffers for snapshot copies, handed back once a version is written.

    On this VM most of a large snapshot's time was faulting in its fresh pages, not
    copying: 0.2 s for the 488 MB of a 16M-parameter b = 8 job into memory malloc
    reused, 3.3-6.2 s into new memory. A `Checkpointer` hands each written snapshot's
    buffers back (`Snapshot.recycle`), and the next snapshot of the same shapes copies
    into them. Only the last recycled snapshot's buffers are kept, so what this holds
    between checkpoints is at most one snapshot's new arrays, which a checkpoint in
    flight holds anyway. Only buffers handed out here are taken back; every byte of a
    reused buffer is overwritten before the snapshot is used. A buffer handed out is
    known only weakly: a snapshot dropped unwritten (one taken outside a checkpointer)
    frees its memory with it (held strongly, a dropped 1.28 GB snapshot of
    bench/checkpoint.py stayed resident to the end: its peak RSS rose 3.96 -> 5.25 GiB).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        # id -> buffer handed out, not yet back (weak: an id leaves with its buffer)
        self._out: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised C-contiguous buffer of `shape` and `dtype`."""
        key = (tuple(shape), np.dtype(dtype).str)
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else np.empty(shape, dtype=dtype)
            self._out[id(buf)] = buf
        return buf

    def recycle(self, arrays: list[np.ndarray]) -> None:
        """Keep those of `arrays` this pool handed out for the next snapshot, dropping
        what it kept before (the caller no longer reads any of them)."""
        kept: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        with self._lock:
            for a in arrays:
                if self._out.pop(id(a), None) is a:
                    kept.setdefault((a.shape, a.dtype.str), []).append(a)
            self._free = kept

    def trim(self) -> None:
        """Drop the kept buffers a snapshot just taken did not use (a first, full
        snapshot's rows beyond the k of the next ones), so they are not held while it
        is written."""
        with self._lock:
            self._free = {}

    def clear(self) -> None:
        """Drop every kept buffer (handed-out ones are forgotten too)."""
        with self._lock:
            self._free = {}
            self._out = weakref.WeakValueDictionary()


#: The process's snapshot buffers.
BUFFERS = SnapshotBuffers()


class SharingRing(Protocol):
    """A ring that can lend a snapshot a live row and call back before overwriting it
    (`tiers.TieredHistory` with every column on one host tier)."""

    def shared_row(self, slot: int) -> np.ndarray | None:
        """A read-only (1, width) view of ring slot `slot`, or None (copy it instead)."""
        ...

    def add_write_guard(self, guard: Callable[[int], None]) -> None:
        """Call `guard(slot)` before any write to `slot`."""
        ...

    def remove_write_guard(self, guard: Callable[[int], None]) -> None:
        """Stop calling `guard`."""
        ...


class SharedRows:
    """Ring rows a snapshot writes straight from the live ring (copy-on-write).

    A checkpoint every k >= b-1 steps had copied every ring slot into its snapshot: a
    second ring (1.03 GB of 85.9M parameters at b = 4) held while the version was
    written, beside the next steps' own peak. A row of the ring is instead lent to the
    snapshot as a read-only view; until the writer has written it, the ring calls
    `before_overwrite` before writing that slot again, which copies the row out (one
    row, into `BUFFERS`) if the writer has not begun it, or waits for the writer to
    finish it if it has. Either way the bytes written are the row as the snapshot saw
    it: no stored bit changes. A checkpoint after step t, one every k steps, lends its
    new rows, those of steps t-k+1..t (all b-1 of them when k >= b-1); the ring writes
    the slot of step s again at step s+b-1, so the oldest lent row is overwritten at
    step t+b-k, which comes before the next checkpoint (after step t+k; it waits for
    this one) when 2k >= b. Only with 2k < b is no lent row reached while its version
    may still be in flight, so nothing is ever copied nor waited for.

    `on_overwrite="wait"` (`LENT_ROW_POLICIES`) is the memory-first choice: a row the
    ring must overwrite before the writer has begun it is not copied; the writer is told
    to write it next (`next_array`) and the ring waits until it has. The step stalls
    for the rest of the array the writer is in and that row; no row is copied (`copied`
    stays 0) unless the writer has not begun it within `max_wait_s`, when it is copied
    out as "copy" does, so a slow or stalled disk costs a step at most that long before
    the row's own write. The writer calls `writer_done` when it stops, written or
    failed, so no ring waits for a writer that is gone.

    Only the rows of a version being written are lent (each `Checkpointer` has its own
    `SharedRows` and takes its snapshot under `lending`); a snapshot taken for any other
    use copies as before.

    A lent row's checksum in its record entry (`format.ring_rows`) is left to the writer
    (`defer_checksum`): the row is alone in its array, so it is the checksum the writer
    computes of that array as it writes it, and `written` puts it in the entry. The
    training thread no longer reads the rows at all (a crc32c pass over k rows, 128 MB
    at 8M parameters, k = 4). The entry holds `PENDING_CHECKSUM` until then, which no
    reader accepts; `check_checksums` refuses to let a record go out with one.
    """

    #: a deferred row checksum's place-holder (not `crc32c:`: every reader refuses it)
    PENDING_CHECKSUM = "pending"

    PENDING, WRITING, DONE = 0, 1, 2

    def __init__(
        self, *, on_overwrite: LentRowPolicy = "copy", max_wait_s: float | None = None
    ) -> None:
        """
        Args:
            on_overwrite: what the ring does before overwriting a lent row the writer
                has not begun: "copy" it out (one row's memory, no stall) or "wait" for
                the writer to write it next (no memory, the step stalls).
            max_wait_s: with "wait", the longest the ring waits for the writer to
                begin the row before it copies the row out as "copy" does (None: as
                long as it takes). Once the writer is in the row the ring waits for
                its end, as "copy" does too.

        Raises:
            ValueError: `on_overwrite` is neither, or `max_wait_s` is negative.
        """
        if on_overwrite not in LENT_ROW_POLICIES:
            raise ValueError(
                f"on_overwrite={on_overwrite!r}: must be one of "
                f"{', '.join(map(repr, LENT_ROW_POLICIES))}"
            )
        if max_wait_s is not None and not max_wait_s >= 0:
            raise ValueError(f"max_wait_s={max_wait_s!r}: must be >= 0 seconds, or None")
        self.on_overwrite: LentRowPolicy = on_overwrite
        self.max_wait_s = max_wait_s
        #: lent rows copied out before the ring overwrote them, over this object's life
        self.copied = 0
        #: seconds the ring waited for the writer before overwriting a lent row, in all
        self.waited_s = 0.0
        # names of lent rows the ring waits on and the writer has not begun: written next
        self._wanted: list[str] = []
        self._cond = threading.Condition()
        self._lending = False
        self._rings: list[SharingRing] = []
        # array name -> [slot, state, ring]; the snapshot's arrays dict is updated on copy
        self._rows: dict[str, list[Any]] = {}
        self._arrays: dict[str, np.ndarray] | None = None
        # every record entry whose checksum was deferred, until released
        self._deferred: list[list[Any]] = []

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """Rows are lent (`lend`) while this context is open (the snapshot's taking)."""
        with self._cond:
            if self._rows:
                raise RuntimeError("a snapshot's lent ring rows were not released")
            self._lending = True
        token = _LENDER.set(self)
        try:
            yield
        except BaseException:
            self.release()  # no snapshot: nothing lent may stay guarded
            raise
        finally:
            _LENDER.reset(token)
            with self._cond:
                self._lending = False

    def lend(self, ring: Any, slot: int) -> np.ndarray | None:
        """Ring slot `slot` as a (1, width) read-only view for a snapshot array, guarded
        until released; None when not lending or the ring cannot lend (copy it)."""
        with self._cond:
            if not self._lending or not hasattr(ring, "shared_row"):
                return None
            view: np.ndarray | None = ring.shared_row(slot)
            if view is None:
                return None
            if not any(r is ring for r in self._rings):
                self._rings.append(ring)
                ring.add_write_guard(self.before_overwrite)
            # the lending order is the rows' step order (`encode_slots`); the last
            # place: the record entry whose checksum the writer fills (`defer_checksum`)
            self._rows[f"#pending{len(self._rows)}"] = [
                slot,
                self.PENDING,
                ring,
                view,
                len(self._rows),
                None,
            ]
            return view

    def defer_checksum(self, view: np.ndarray, entry: list[Any]) -> bool:
        """Leave the checksum of a lent row (`view`, as `lend` returned it) to the writer:
        `entry[4]` becomes `PENDING_CHECKSUM` until `written` fills it; False (nothing
        changed) when `view` is no row lent now."""
        with self._cond:
            for lent in self._rows.values():
                if lent[3] is view and lent[1] == self.PENDING:
                    entry[4] = self.PENDING_CHECKSUM
                    lent[5] = entry
                    self._deferred.append(entry)
                    return True
            return False

    def check_checksums(self) -> None:
        """Raise unless every deferred checksum is filled: called before the records
        are written, so a record never holds a place-holder."""
        with self._cond:
            for entry in self._deferred:
                if entry[4] == self.PENDING_CHECKSUM:
                    raise RuntimeError(
                        f"the ring row of slot entry {entry[:4]} was not written, so the "
                        "entry has no checksum: the version's records must not be written"
                    )

    def adopt(self, arrays: dict[str, np.ndarray]) -> bool:
        """Bind the rows lent since `lending` to the snapshot's `arrays` (by identity);
        True when any was lent (the writer must then `claim` and `written` each)."""
        with self._cond:
            named: dict[str, list[Any]] = {}
            for entry in self._rows.values():
                for name, arr in arrays.items():
                    if arr is entry[3]:
                        named[name] = entry
            self._rows = named
            self._arrays = arrays
            return bool(named)

    def is_lent(self, name: str) -> bool:
        """Array `name` of the adopted snapshot is a lent ring row."""
        with self._cond:
            return name in self._rows

    def step_of(self, name: str) -> int:
        """The lent row `name`'s place in step order (0: the oldest)."""
        with self._cond:
            return int(self._rows[name][4])

    def claim(self, name: str) -> np.ndarray | None:
        """The writer begins array `name`: its current array (the view, or the copy made
        before the ring overwrote it); None when `name` is not a lent row."""
        with self._cond:
            entry = self._rows.get(name)
            if entry is None or self._arrays is None:
                return None
            if entry[1] == self.PENDING:
                entry[1] = self.WRITING
            return self._arrays[name]

    def written(self, name: str, checksum: str | None = None) -> None:
        """The writer is done with array `name`: the ring may overwrite its slot. With
        `checksum` (the array's, as written), a lent row's deferred entry gets it."""
        with self._cond:
            entry = self._rows.get(name)
            if entry is not None:
                entry[1] = self.DONE
                if name in self._wanted:
                    self._wanted.remove(name)
                if checksum is not None and entry[5] is not None:
                    entry[5][4] = checksum
                self._cond.notify_all()

    def before_overwrite(self, slot: int) -> None:
        """Called by the ring before it writes `slot`: copy out a lent row of it the
        writer has not begun (`on_overwrite="copy"`; with "wait", have the writer take
        it next and wait, copying it out after `max_wait_s` if the writer has still not
        begun it), or wait until the writer has finished one it is writing."""
        with self._cond:
            for name, entry in list(self._rows.items()):  # the waits below let go
                if entry[0] != slot or entry[1] == self.DONE or self._arrays is None:
                    continue
                start = time.perf_counter()
                if entry[1] == self.PENDING and self.on_overwrite == "wait":
                    self._wanted.append(name)
                    self._cond.notify_all()
                    self._cond.wait_for(_begun(entry), timeout=self.max_wait_s)
                    if entry[1] == self.PENDING:  # not begun in max_wait_s: copied below
                        self._wanted.remove(name)
                if entry[1] == self.PENDING and self._arrays is not None:
                    self.waited_s += time.perf_counter() - start
                    view = self._arrays[name]
                    copy = BUFFERS.take(view.shape, view.dtype)
                    copy[...] = view
                    self._arrays[name] = copy
                    self.copied += 1
                    entry[1] = self.DONE  # the ring no longer holds what is written
                    continue
                self._cond.wait_for(_done(entry))
                self.waited_s += time.perf_counter() - start

    def next_array(self, names: list[str]) -> str:
        """The array of `names` (the writer's remaining ones, in its order) to write
        next: a lent row the ring waits on, else the first."""
        with self._cond:
            for name in self._wanted:
                if name in names:
                    return name
            return names[0]

    def writer_done(self) -> None:
        """The writer has stopped (its version written, or failed): nothing more is
        read from the lent rows, so no ring waits for them."""
        with self._cond:
            for entry in self._rows.values():
                entry[1] = self.DONE
            self._wanted = []
            self._cond.notify_all()

    def release(self) -> None:
        """The version is written (or failed): the ring writes freely again."""
        with self._cond:
            self.writer_done()  # a ring waiting on a row writes now
            for ring in self._rings:
                ring.remove_write_guard(self.before_overwrite)
            self._rings = []
            self._rows = {}
            self._arrays = None
            self._deferred = []


def _done(entry: list[Any]) -> Callable[[], bool]:
    return lambda: bool(entry[1] == SharedRows.DONE)


def _begun(entry: list[Any]) -> Callable[[], bool]:
    return lambda: bool(entry[1] != SharedRows.PENDING)


_LENDER: contextvars.ContextVar[SharedRows | None] = contextvars.ContextVar(
    "cocoon_ckpt_lender", default=None
)


def lend_row(ring: Any, slot: int) -> np.ndarray | None:
    """Ring slot `slot` lent to the snapshot being taken under `SharedRows.lending`
    (a read-only (1, width) view), or None: copy it."""
    lender = _LENDER.get()
    return None if lender is None else lender.lend(ring, slot)


def defer_row_checksum(view: np.ndarray, entry: list[Any]) -> bool:
    """Leave a lent row's record checksum (`entry[4]`) to the writer of the snapshot
    being taken under `SharedRows.lending` (`SharedRows.defer_checksum`); False: compute
    it now."""
    lender = _LENDER.get()
    return False if lender is None else lender.defer_checksum(view, entry)


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A contiguous host copy of `t` that the trainer can no longer change (in a buffer
    of `BUFFERS`)."""
    src = t.detach().cpu().contiguous().numpy()
    out = BUFFERS.take(src.shape, src.dtype)
    out[...] = src
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Encoded(Generic[R]):
    """One part of a trainer's state as a version holds it: a record and the arrays
    the record names. A part's codec returns it; nothing is filled in by side effect."""

    record: R
    """The part's record (JSON-able; its arrays named, never inlined)."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """Host copies new in this version, by array name (`layout.py`)."""
    references: dict[str, ArrayMeta] = field(default_factory=dict)
    """Arrays an earlier version holds and this one names again (old ring rows)."""
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    """Job-lifetime arrays new in this version, written once under shared/ (a table's
    CSC and noise order)."""


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """A host-memory copy of one checkpoint, ready to be written."""

    step: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    references: dict[str, ArrayMeta] = field(default_factory=dict)
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    """Job-lifetime arrays new in this version (the precomputed CSC): written once
    under shared/, referenced by every later version. Not copied: they never change."""
    shard: RankShard | None = None
    """This rank's ring shard (a multi-process job's coordinator gathers every rank's)."""
    records: dict[str, Any] = field(default_factory=dict)
    """Every record to write (`SnapshotRecords` plus the runner's; empty on a rank
    other than the coordinator)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def recycle(self) -> None:
        """Hand this snapshot's buffers back to `BUFFERS` once it is written; its arrays
        must not be read after (the next snapshot overwrites them)."""
        BUFFERS.recycle(list(self.arrays.values()))
        self.arrays = {}

    def take(self, part: Encoded[R]) -> R:
        """Add a part's arrays, references and shared arrays to this snapshot; its
        record back.

        Raises:
            ValueError: an array name another part already took (two parts must never
                write one array: the second would silently replace the first).
        """
        for name in (*part.arrays, *part.references, *part.shared):
            if name in self.arrays or name in self.references or name in self.shared:
                raise ValueError(f"array {name} is encoded by two parts of the snapshot")
        self.arrays.update(part.arrays)
        self.references.update(part.references)
        self.shared.update(part.shared)
        return part.record
