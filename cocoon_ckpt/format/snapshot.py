"""`Snapshot`: one checkpoint in host memory, ready to be written; `Encoded`, what a
part's codec returns (its record and its arrays), which the snapshot takes in;
`host_copy`, how a part copies a live tensor into it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from cocoon_ckpt.records import RankShard
from state import ArrayMeta

__all__ = ["Encoded", "Snapshot", "host_copy"]

R = TypeVar("R")


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A contiguous host copy of `t` that the trainer can no longer change."""
    return t.detach().cpu().contiguous().numpy().copy()


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
