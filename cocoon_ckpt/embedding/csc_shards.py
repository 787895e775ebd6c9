"""Coalesced noise on several ranks: each rank precomputes and holds the CSC of its
share of a table's cold slots, and the ranks gather each step's column.

The shares are ranges of whole precompute tiles. A table's tiles (`precompute`'s
`tile_rows` slots each, aligned to multiples of it) do not depend on the world size, so
the ranges do not either beyond which tiles a rank takes: the tiles are cut into
`world` contiguous runs (`share_counts` over the tiles, as lazy noise splits its
draws), and rank r holds run (r + i) mod world of the job's i-th table, so tables of
fewer tiles than ranks do not all land on rank 0. A rank computes only its tiles; every entry is the same bits as the one-process
precompute's, because an entry's arithmetic never involves another tile.

Stored, a rank's part is three arrays named by the slot range they cover,
`emb/<param>/csc/slots-<start>-<stop>/{col_ptr,rows,values}`: a CSC over the same n + 1
columns holding only the entries of rows whose slot lies in [start, stop) (an empty run
is neither stored nor listed). A version
lists its parts in the table's `csc` record (`parts`); one process's whole CSC is the
part [H, R) under the old names (`emb/<param>/csc/...`), so a one-rank store is
unchanged. A resume on any world size reads, for its own range, the parts that overlap
it and keeps the entries whose slot falls inside (`StoredParts.load`): parts never need
to line up with the new ranges, and the entries a rank ends up with are the one-process
CSC's restricted to its slots, bit for bit.

Each step the ranks apply the same column: each sends its part's column t (an
all-gather) and every rank applies every entry, sorted by row as the one-process column
is, so the tables stay identical on every rank and equal to one process's. With
`csc_window_steps`, once a version holds the parts a rank reads its own part from the
store in windows (`PartWindows`) instead of holding it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.csc_window import CSC_PARTS, CscWindows, StoredCSC
from cocoon_ckpt.embedding.lazy import share_counts
from cocoon_ckpt.errors import StoredStateError
from cocoon_ckpt.layout import csc_part_name
from state import ArrayMeta, CorruptVersionError, Version

__all__ = [
    "CscPart",
    "CscRanks",
    "PartWindows",
    "StoredParts",
    "part_bounds",
    "part_name",
    "restrict",
    "tile_edges",
    "whole_csc",
]


class CscRanks(Protocol):
    """The ranks that share a table's CSC (`train.distributed.DistContext`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (a collective)."""
        ...


def tile_edges(hot: int, rows: int, tile_rows: int) -> list[int]:
    """The precompute's tile boundaries over the cold slots [hot, rows): hot, the
    multiples of `tile_rows` inside, rows (as `precompute._tiles` cuts them)."""
    inner = range((hot // tile_rows + 1) * tile_rows, rows, tile_rows)
    return [hot, *inner, rows] if rows > hot else [hot, hot]


def part_bounds(hot: int, rows: int, tile_rows: int, world: int) -> list[tuple[int, int]]:
    """[start, stop) of the cold slots each of `world` ranks precomputes and holds:
    contiguous runs of whole tiles, as even as they split (`share_counts`)."""
    edges = tile_edges(hot, rows, tile_rows)
    counts = share_counts(len(edges) - 1, world)
    cuts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(edges[int(a)], edges[int(z)]) for a, z in zip(cuts[:-1], cuts[1:], strict=True)]


#: A stored part's array: `emb/<param>/csc/slots-<start>-<stop>/<array>`.
part_name = csc_part_name


def part_entries(counts: np.ndarray, order: np.ndarray, start: int, stop: int) -> int:
    """Entries of slots [start, stop): one per read of each of their rows, and a tail."""
    return int(counts[order[start:stop]].sum()) + (stop - start)


def part_nbytes(steps: int, entries: int, dim: int, itemsize: int) -> int:
    """What a part of `entries` entries takes in memory (col_ptr, rows, values)."""
    return (steps + 2) * 8 + entries * 8 + entries * dim * itemsize


@dataclass(frozen=True, slots=True)
class CscPart(CoalescedCSC):
    """A rank's part of a table's CSC: the entries of the rows whose slot lies in
    [start, stop), with every rank's range (`bounds`, in rank order) and each range's
    entry count, so the coordinator's record names every part."""

    start: int = 0
    stop: int = 0
    bounds: tuple[tuple[int, int], ...] = ()
    entries: tuple[int, ...] = ()

    @property
    def whole_nnz(self) -> int:
        return sum(self.entries)

    @classmethod
    def of(
        cls,
        csc: CoalescedCSC,
        start: int,
        stop: int,
        bounds: Sequence[tuple[int, int]],
        entries: Sequence[int],
    ) -> CscPart:
        return cls(csc.col_ptr, csc.rows, csc.values, start, stop, tuple(bounds), tuple(entries))


def restrict(csc: CoalescedCSC, slot_of: np.ndarray, start: int, stop: int) -> CoalescedCSC:
    """The entries of `csc` whose row's slot (`slot_of[row]`) lies in [start, stop),
    same columns, same order."""
    s = slot_of[csc.rows]
    keep = (s >= start) & (s < stop)
    cols = np.repeat(np.arange(csc.col_ptr.size - 1), np.diff(csc.col_ptr))
    counts = np.bincount(cols[keep], minlength=csc.col_ptr.size - 1)
    ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return CoalescedCSC(ptr, csc.rows[keep], np.ascontiguousarray(csc.values[keep]))


def merge(steps: int, parts: Sequence[CoalescedCSC], dim: int, dtype: Any) -> CoalescedCSC:
    """One CSC of the entries of `parts` (disjoint rows), sorted by (column, row) as
    the one-process precompute sorts them."""
    parts = [p for p in parts if p.nnz]
    if not parts:
        return CoalescedCSC(
            np.zeros(steps + 2, np.int64), np.zeros(0, np.int64), np.zeros((0, dim), dtype)
        )
    if len(parts) == 1:
        return parts[0]
    cols = [np.repeat(np.arange(steps + 1), np.diff(p.col_ptr)) for p in parts]
    return CoalescedCSC.from_entries(
        steps,
        np.concatenate(cols),
        np.concatenate([p.rows for p in parts]),
        np.concatenate([p.values for p in parts]),
    )


@dataclass(frozen=True, slots=True)
class StoredParts:
    """A table's CSC as a version holds it on several ranks: its parts, not read yet.

    Attributes:
        version: the committed version.
        param: the table's parameter name.
        steps: n.
        dim: the table's width.
        parts: each part's [start, stop) and its arrays' manifest entries.
    """

    version: Version
    param: str
    steps: int
    dim: int
    parts: tuple[tuple[int, int, dict[str, ArrayMeta]], ...]

    @classmethod
    def of_version(
        cls, version: Version, param: str, record: dict[str, Any], dim: int | None = None
    ) -> StoredParts:
        """Table `param`'s CSC parts, as its `csc` record lists them (`dim`: the table's
        width, for a table without cold rows, whose record lists no part).

        Raises:
            CorruptVersionError: a listed part is not in the version.
        """
        parts = []
        for p in record["parts"]:
            a, z = int(p["start"]), int(p["stop"])
            names = {k: part_name(param, a, z, k) for k in CSC_PARTS}
            missing = [n for n in names.values() if n not in version.manifest.arrays]
            if missing:
                raise CorruptVersionError(
                    f"version {version.version} of {version.store.url}: the CSC of table "
                    f"{param} lists a part of slots [{a}, {z}) whose array {missing[0]} is "
                    "not in the version",
                    version=version.version,
                    path=missing[0],
                )
            parts.append((a, z, {k: version.manifest.arrays[n] for k, n in names.items()}))
        width = int(parts[0][2]["values"].shape[1]) if parts else (dim or 0)
        return cls(version, param, int(record["steps"]), width, tuple(parts))

    @classmethod
    def of_manifest(
        cls, version: Version, param: str, bounds: Sequence[tuple[int, int]], steps: int, dim: int
    ) -> StoredParts | None:
        """The parts of slots `bounds` (every rank's, empty ones skipped) where `version`
        holds each of them; None where it does not hold them all."""
        parts = []
        for a, z in bounds:
            if z == a:
                continue
            names = {k: part_name(param, a, z, k) for k in CSC_PARTS}
            if any(n not in version.manifest.arrays for n in names.values()):
                return None
            parts.append((a, z, {k: version.manifest.arrays[n] for k, n in names.items()}))
        return cls(version, param, steps, dim, tuple(parts))

    @property
    def nnz(self) -> int:
        return sum(int(m["rows"].shape[0]) for _, _, m in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(
            math.prod(m.shape) * np.dtype(m.dtype).itemsize
            for _, _, metas in self.parts
            for m in metas.values()
        )

    def load(self, slot_of: np.ndarray, start: int, stop: int) -> CoalescedCSC:
        """The entries of slots [start, stop), read from the parts that overlap it (each
        verified against the manifest), sorted by (column, row).

        Raises:
            StoredStateError: the parts do not cover [start, stop).
        """
        covered = sum(max(0, min(z, stop) - max(a, start)) for a, z, _ in self.parts)
        if covered != stop - start:
            raise StoredStateError(
                f"version {self.version.version}: the stored CSC parts of table {self.param} "
                f"cover {covered} of the {stop - start} slots [{start}, {stop}) this rank needs"
            )
        got = []
        for a, z, _ in self.parts:
            if z <= start or a >= stop:
                continue
            csc = CoalescedCSC.from_arrays(
                {k: self.version.array(part_name(self.param, a, z, k)) for k in CSC_PARTS}
            )
            got.append(csc if start <= a and z <= stop else restrict(csc, slot_of, start, stop))
        dtype = self.parts[0][2]["values"].dtype if self.parts else "float32"
        return merge(self.steps, got, self.dim, np.dtype(dtype))


@dataclass(frozen=True, slots=True)
class PartWindows(StoredParts):
    """A table's CSC committed in parts, of which this rank reads its own part, the
    slots [start, stop), from the store in windows (`csc_window.CscWindows`: at most two
    windows in memory, every window checked), never whole. As state it is the
    committed parts (a version references them)."""

    windows: CscWindows | None = None
    start: int = 0
    stop: int = 0

    @classmethod
    def of(
        cls,
        stored: StoredParts,
        start: int,
        stop: int,
        window_steps: int,
        like: CoalescedCSC | None = None,
    ) -> PartWindows | None:
        """This rank's part [start, stop) of `stored` read in windows of `window_steps`
        steps (`like`: the part in memory, whose window checksums are taken instead of
        a pass over the store); None where no stored part is exactly that range (a
        resume on another world size: the part is then read whole, `load`)."""
        for a, z, _ in stored.parts:
            if (a, z) != (start, stop):
                continue
            names = {k: part_name(stored.param, a, z, k) for k in CSC_PARTS}
            one = StoredCSC.of_arrays(stored.version, stored.param, names)
            windows = CscWindows(one, window_steps, like=like)
            return cls(
                stored.version, stored.param, stored.steps, stored.dim, stored.parts,
                windows, start, stop,
            )  # fmt: skip
        return None

    def _windows(self) -> CscWindows:
        if self.windows is None:
            raise RuntimeError(f"table {self.param}: its CSC part has no windows")
        return self.windows

    def column(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Column t of this rank's part (t = steps: its tails, gathered whole)."""
        return self._windows().column(t)

    def close(self) -> None:
        self._windows().close()


def whole_csc(version: Version, param: str, record: dict[str, Any]) -> CoalescedCSC:
    """Table `param`'s whole CSC as `version` holds it (`record`: the table's `csc`
    record): one process's arrays, or every part merged, sorted by (column, row): the
    one-process CSC's bits either way (how a reader of the whole CSC reads parts)."""
    if "parts" not in record:
        return StoredCSC.of_version(version, param).load()
    stored = StoredParts.of_version(version, param, record)
    got = [
        CoalescedCSC.from_arrays({k: version.array(part_name(param, a, z, k)) for k in CSC_PARTS})
        for a, z, _ in stored.parts
    ]
    dtype = stored.parts[0][2]["values"].dtype if stored.parts else "float32"
    return merge(stored.steps, got, stored.dim, np.dtype(dtype))


def load_range(
    stored: StoredCSC | StoredParts, slot_of: np.ndarray, start: int, stop: int
) -> CoalescedCSC:
    """The entries of slots [start, stop) of a committed CSC, whole (one process's) or
    in parts (several ranks')."""
    if isinstance(stored, StoredParts):
        return stored.load(slot_of, start, stop)
    return restrict(stored.load(), slot_of, start, stop)
