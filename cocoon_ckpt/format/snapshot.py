"""`Snapshot`: one checkpoint in host memory, ready to be written; `Encoded`, what a
part's codec returns (its record and its arrays), which the snapshot takes in;
`host_copy`, how a part copies a live tensor into it; `BUFFERS`, the host buffers a
checkpointer's snapshots reuse."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from cocoon_ckpt.records import RankShard
from state import ArrayMeta

__all__ = ["BUFFERS", "Encoded", "SnapshotBuffers", "Snapshot", "host_copy"]

R = TypeVar("R")


class SnapshotBuffers:
    """Host buffers for snapshot copies, handed back once a version is written.

    On this VM most of a large snapshot's time was faulting in its fresh pages, not
    copying: 0.2 s for the 488 MB of a 16M-parameter b = 8 job into memory malloc
    reused, 3.3-6.2 s into new memory. A `Checkpointer` hands each written snapshot's
    buffers back (`Snapshot.recycle`), and the next snapshot of the same shapes copies
    into them. Only the last recycled snapshot's buffers are kept, so what this holds
    between checkpoints is at most one snapshot's new arrays, which a checkpoint in
    flight holds anyway. Only buffers handed out here are taken back; every byte of a
    reused buffer is overwritten before the snapshot is used.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[tuple[int, ...], str], list[np.ndarray]] = {}
        self._out: dict[int, np.ndarray] = {}  # id -> buffer handed out, not yet back

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
            self._out = {}


#: The process's snapshot buffers.
BUFFERS = SnapshotBuffers()


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
