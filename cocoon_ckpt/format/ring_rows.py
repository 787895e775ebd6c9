"""A version's ring slots as rows: the slots new in a version stored as one (k, width)
array (one per 16 MiB chunk of rows), every slot of the record referenced by (array, row).

One array per version instead of one per slot: a checkpoint every k steps writes one
zarr.json and a chunk file for its k new slots, not k folders of each. A record's
slot entry (`noise.shards[i].slots`, `embedding.tables[j].slots`) takes one of two forms:

- `[slot, step, array, row, checksum]`: row `row` of the 2-D array `array`, whose
  C-order bytes have the crc32c `checksum` (`crc32c:%08x`). The array's own checksum
  (the manifest's) is what every read verifies; the row checksums name the damaged
  slot when an array fails it.
- `[slot, step, array]`: stores written before rows: the 1-D array `array` is the slot.
  Read, resumed from and audited as before; a new version borrows such slots as they are.

Trainer-free and torch-free: the tools read slots through this module too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import crc32c
import numpy as np

from cocoon_ckpt.dp.ring import HostRing, RingHistory
from cocoon_ckpt.records import RingSlot, ShardRecord
from state import ArrayMeta, CorruptVersionError, Manifest, Store, Version
from state.arrays import CHUNK_BYTES, chunk_key

__all__ = [
    "SlotRef",
    "borrowable",
    "damaged_rows",
    "encode_slots",
    "load_ring",
    "row_checksum",
    "rows_by_array",
    "slot_refs",
    "slot_values",
]


class SlotRef(NamedTuple):
    """One stored ring slot, parsed from either record form."""

    slot: int
    """Index in the ring (t mod (b-1))."""
    step: int
    """The step t whose w_t the slot holds."""
    array: str
    """The version array holding it (logical name)."""
    row: int | None
    """Its row in that (k, width) array; None: the array is the slot (older stores)."""
    checksum: str | None
    """`crc32c:` of the row's bytes; None with `row`."""

    def to_record(self) -> RingSlot:
        """The record entry, in the form it was read in."""
        if self.row is None:
            return [self.slot, self.step, self.array]
        return [self.slot, self.step, self.array, self.row, self.checksum]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is {value!r}, not an integer")
    return value


def slot_refs(entries: Any, what: str = "ring") -> list[SlotRef]:
    """Parse a record's slot entries (either form).

    Args:
        entries: the record's `slots` list.
        what: names the ring in errors (`ring`, `table emb.weight`).

    Raises:
        ValueError: an entry of neither form, naming it.
    """
    if not isinstance(entries, list):
        raise ValueError(f"{what} slots are {type(entries).__name__}, not a list")
    out: list[SlotRef] = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) not in (3, 5):
            raise ValueError(
                f"{what} slot entry {entry!r} is neither [slot, step, array] nor "
                "[slot, step, array, row, checksum]"
            )
        if not isinstance(entry[2], str):
            raise ValueError(f"{what} slot entry {entry!r}: the array name is not a string")
        slot, step = _int(entry[0], f"{what} slot index"), _int(entry[1], f"{what} slot step")
        if len(entry) == 3:
            out.append(SlotRef(slot, step, entry[2], None, None))
            continue
        row = _int(entry[3], f"{what} slot row")
        if row < 0 or not isinstance(entry[4], str) or not entry[4].startswith("crc32c:"):
            raise ValueError(f"{what} slot entry {entry!r}: row or checksum is malformed")
        out.append(SlotRef(slot, step, entry[2], row, entry[4]))
    return out


def row_checksum(row: np.ndarray) -> str:
    """`crc32c:` of a row's C-order bytes (as the manifest spells array checksums)."""
    return f"crc32c:{crc32c.crc32c(np.ascontiguousarray(row).data.cast('B')):08x}"


# -- writing ------------------------------------------------------------------------


def borrowable(parent: Manifest | None, entries: Any) -> dict[int, SlotRef]:
    """The slots a version can borrow from its parent, by step: those the parent's
    ring (`entries`, the same ring of the same columns) lists, whose array the parent
    names. None or no entries: nothing to borrow."""
    if parent is None or entries is None:
        return {}
    return {r.step: r for r in slot_refs(entries) if r.array in parent.arrays}


def encode_slots(
    history: RingHistory,
    slot_steps: list[int | None],
    rows_name: Callable[[int, int], str],
    parent: Manifest | None,
    borrowed: Mapping[int, SlotRef],
    arrays: dict[str, np.ndarray],
    references: dict[str, ArrayMeta],
    *,
    take: Callable[[tuple[int, ...], np.dtype[Any]], np.ndarray] = np.empty,
    lend: Callable[[RingHistory, int], np.ndarray | None] | None = None,
    defer: Callable[[np.ndarray, RingSlot], bool] | None = None,
) -> list[RingSlot]:
    """A ring's slot entries: slots the parent holds are borrowed (their arrays
    referenced), the new ones copied into one (k, width) array, rows in step order
    (split into arrays of at most one 16 MiB chunk of rows each).

    Only the k new rows are copied (`history.read`): the training thread never
    gathers the whole ring for a checkpoint.

    Args:
        history: the live ring.
        slot_steps: the step each slot holds (None: never written).
        rows_name: the array name of new rows from their first to last step.
        parent: the version this one follows (None: the first).
        borrowed: `borrowable(parent, ...)` of this ring.
        arrays: the snapshot's new arrays; the new rows' array is added.
        references: the snapshot's borrowed arrays; the parent's are added.
        take: allocates the new rows' arrays (a snapshot's reused buffers,
            `SnapshotBuffers.take`; default fresh memory).
        lend: a row alone in its array (one of 16 MiB or more) as a view of the live
            ring instead of a copy (`SharedRows.lend`: guarded until written), or None
            to copy it.
        defer: takes a lent row and its entry, and leaves the entry's checksum to the
            writer, which computes it of the row's one-row array as it writes it
            (`SharedRows.defer_checksum`); False, or None: computed here.

    Returns:
        The record's entries, in slot order.
    """
    held = [(slot, step) for slot, step in enumerate(slot_steps) if step is not None]
    fresh = sorted(
        (step, slot)
        for slot, step in held
        if parent is None or step >= parent.step or step not in borrowed
    )
    entries: dict[int, RingSlot] = {}
    # At most one chunk of rows per array: a restore reads a version's arrays in
    # parallel (`state.Version.verify`), so one big array would read on one thread
    # (0.37 of np.load measured, against 1.07 with the rows split).
    per_array = max(1, CHUNK_BYTES // max(1, history.width * history.dtype.itemsize))
    for lo in range(0, len(fresh), per_array):
        run = fresh[lo : lo + per_array]
        name = rows_name(run[0][0], run[-1][0])
        lent = lend(history, run[0][1]) if lend is not None and len(run) == 1 else None
        block = take((len(run), history.width), history.dtype) if lent is None else lent
        for row, (step, slot) in enumerate(run):
            if lent is None:
                history.read(slot, out=block[row])  # straight into the snapshot
            entry: RingSlot = [slot, step, name, row, None]
            if lent is None or defer is None or not defer(lent, entry):
                entry[4] = row_checksum(block[row])
            entries[slot] = entry
        arrays[name] = block
    for slot, step in held:
        if slot in entries or parent is None:
            continue  # without a parent every slot is new
        ref = borrowed[step]
        references[ref.array] = parent.arrays[ref.array]
        entries[slot] = [slot, *ref.to_record()[1:]]
    return [entries[slot] for slot, _ in held]


# -- reading ------------------------------------------------------------------------


def slot_values(version: Version, ref: SlotRef) -> np.ndarray:
    """The stored w of one slot, (width,): its row of a verified array (a view: copy
    before changing it), or the whole 1-D array of an older store.

    Raises:
        KeyError: the version has no such array.
        CorruptVersionError: the array fails verification, or is not of the slot's form
            (a row outside it, a 1-D array named with a row).
    """
    arr = version.array(ref.array)
    if ref.row is None and arr.ndim == 1:
        return arr
    if ref.row is not None and arr.ndim == 2 and ref.row < arr.shape[0]:
        row: np.ndarray = arr[ref.row]
        return row
    meta = version.manifest.arrays[ref.array]
    raise CorruptVersionError(
        f"version {version.version}: ring slot of step {ref.step} names row {ref.row} of "
        f"array {ref.array}, which is {meta.dtype}{list(meta.shape)}: the record and the "
        "array disagree; resume from another version",
        version=version.version,
        path=meta.path,
    )


def load_ring(noise: dict[str, Any], shards: list[ShardRecord], version: Version) -> dict[str, Any]:
    """The BandMFNoise state of `noise`'s [start, stop) (a live state dict, read
    for its range, ring shape and dtype) from stored ring shards of any split, slots
    in either record form: only the overlaps are read (I1 and the fixed-order kernel
    make the noise independent of how it was split).

    The slots are written one by one into the live ring `noise["ring"]` itself (a
    `RingHistory`), which the returned state names: a ring larger than host memory,
    whose far part is a file on disk, is restored through one (width,) row, never
    gathered whole. Every slot is written, zeros where the version stores none, but
    for a slot that holds zeros already (`TieredHistory.holds_zeros`: never written
    since its tiers were allocated, as on a resume's new far file)."""
    start, stop = noise["start"], noise["stop"]
    like = noise["ring"]
    into = like if isinstance(like, RingHistory) else HostRing(like.slots, like.width, like.dtype)
    slot_steps: list[int | None] = [None] * like.slots
    stored: list[list[tuple[ShardRecord, SlotRef]]] = [[] for _ in range(like.slots)]
    for shard in shards:
        for ref in slot_refs(shard["slots"]):
            slot_steps[ref.slot] = ref.step
            stored[ref.slot].append((shard, ref))
    holds_zeros = getattr(into, "holds_zeros", None)  # `tiers.TieredHistory`
    row = np.empty(like.width, dtype=like.dtype)
    for slot, parts in enumerate(stored):
        row[...] = 0
        filled = False
        for shard, ref in parts:
            lo, hi = max(shard["start"], start), min(shard["stop"], stop)
            if hi > lo:
                values = slot_values(version, ref)
                row[lo - start : hi - start] = values[lo - shard["start"] : hi - shard["start"]]
                filled = True
        if filled or holds_zeros is None or not holds_zeros(slot):
            into.write(slot, row)  # zeros too, unless the slot holds them already
    return {**noise, "slot_steps": slot_steps, "ring": into}


def rows_by_array(records: Mapping[str, Any]) -> dict[str, list[tuple[str, SlotRef]]]:
    """Every ring slot a version's records store as a row, by array: (which ring, its
    ref). Rings whose entries do not parse are left out (the audit's bounds check
    reports them)."""

    def listed(rec: Any, key: str) -> list[dict[str, Any]]:
        items = rec.get(key) if isinstance(rec, dict) else None
        return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []

    rings = [("ring", s.get("slots")) for s in listed(records.get("noise"), "shards")]
    rings += [
        (f"table {t.get('param')}", t.get("slots"))
        for t in listed(records.get("embedding"), "tables")
    ]
    out: dict[str, list[tuple[str, SlotRef]]] = {}
    for what, entries in rings:
        try:
            refs = slot_refs(entries, what)
        except ValueError:
            continue
        for ref in refs:
            if ref.row is not None:
                out.setdefault(ref.array, []).append((what, ref))
    return out


def _chunk_bytes(store: Store, meta: ArrayMeta, index: int) -> bytes | None:
    """A chunk file of a 2-D array as stored (zarr v3 default key `c.<i>.0`, `c/<i>/0`
    in a format-2 version: the rows' bytes, edge padding, then a 4-byte crc32c); None
    if it cannot be read."""
    try:
        return store.backend.read_bytes(f"{meta.path}/{chunk_key(index, 2, meta.separator)}")
    except (OSError, ValueError):
        return None


def damaged_rows(store: Store, meta: ArrayMeta, refs: Iterable[SlotRef]) -> list[SlotRef]:
    """Which of `refs` (rows of the array `meta` describes, which failed its checksum)
    are damaged: each row's stored bytes checked against its recorded checksum, read
    straight from the chunk files (a diagnosis, never data to use).

    Returns:
        The damaged rows' refs; every ref when the layout is unknown (no recorded chunk
        shape, not a 2-D array).
    """
    refs = [r for r in refs if r.row is not None]
    if meta.chunks is None or len(meta.shape) != 2 or len(meta.chunks) != 2:
        return refs
    per_chunk = max(1, meta.chunks[0])
    row_bytes = meta.shape[1] * np.dtype(meta.dtype).itemsize
    bad: list[SlotRef] = []
    chunks: dict[int, bytes | None] = {}
    for ref in refs:
        row = ref.row or 0
        index = row // per_chunk
        if index not in chunks:
            chunks[index] = _chunk_bytes(store, meta, index)
        raw = chunks[index]
        lo = (row - index * per_chunk) * row_bytes
        if (
            raw is None
            or len(raw) != per_chunk * row_bytes + 4
            or f"crc32c:{crc32c.crc32c(raw[lo : lo + row_bytes]):08x}" != ref.checksum
        ):
            bad.append(ref)
    return bad
