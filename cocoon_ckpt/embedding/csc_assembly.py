"""A coalesced table's CSC assembled on disk and written to the store as it is sorted,
so the precompute never holds it whole (`EmbeddingConfig.csc_window_steps` with a
store).

The CSC's shape is known before any tile is computed: column t holds one entry per cold
row step t reads, column n one tail per cold row (`expected_col_ptr`). Its columns are
split into buckets of a few windows. Each finished tile's entries (in memory anyway,
one tile at a time) are split by bucket and appended to that bucket's spill files, each
with a running crc32c; once every tile is in, bucket after bucket is read back, its crc
checked, sorted by (column, row) as `CoalescedCSC.from_entries` sorts, checked against
the expected column pointer, and appended to the store's `rows` and `values` arrays
chunk by chunk (`state.arrays`' chunk layout: payload, padding, crc32c). Entries of one
row never share a column, so the order, and with it every byte, is the in-memory
CSC's, for any tiling and any order of tiles.

Peak memory: one tile's entries and their split copy, or one bucket and its sorted
copy, plus one chunk per array being filled. The spill files lie under the store's
`shared/precompute/` on local disk (deleted with the tile parts once a version holds
the CSC) and in a private temporary folder otherwise.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import tempfile
from typing import Any

import crc32c
import numpy as np

from cocoon_ckpt.embedding.csc_window import (
    StoredCSC,
    WindowCrcs,
    window_edges,
    window_layout,
)
from cocoon_ckpt.embedding.precompute import TileEntries
from cocoon_ckpt.embedding.schedule import AccessSchedule
from cocoon_ckpt.embedding.stored_tiles import PRECOMPUTE
from cocoon_ckpt.layout import emb_name
from state import ArrayMeta, Store, StoreError
from state import arrays as state_arrays
from state.arrays import (
    CHUNK_SEPARATOR,
    array_metadata,
    chunk_key,
    default_dimension_names,
    ensure_groups,
)
from state.paths import SHARED, shared_path

__all__ = ["CscAssembly", "expected_col_ptr"]

#: A bucket's spill holds at least this many bytes (fewer, larger spill files), unless
#: the whole CSC is smaller; at most two of the reader's windows otherwise.
MIN_BUCKET_BYTES = 8 << 20


def expected_col_ptr(schedule: AccessSchedule, order: np.ndarray, hot: int) -> np.ndarray:
    """(n+2,) int64: the column pointer of a table's CSC, from its schedule alone."""
    n = schedule.steps
    slot = np.empty(schedule.rows, dtype=np.int64)
    slot[order] = np.arange(schedule.rows, dtype=np.int64)
    cold = slot[schedule.step_rows] >= hot
    step_of = np.repeat(np.arange(n, dtype=np.int64), np.diff(schedule.step_ptr))
    counts = np.bincount(step_of[cold], minlength=n).astype(np.int64)
    counts = np.append(counts, schedule.rows - hot)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


class CscAssembly:
    """The CSC of one table, assembled from its tiles' entries on disk.

    Args:
        store: the job's store (its writer lease held).
        param: the table's parameter name.
        schedule, order, hot: the table's schedule, noise order and H (its CSC's
            column pointer, `expected_col_ptr`, and its cold rows follow).
        dim, dtype: the values' width and dtype.
        window_steps: the reader's window (`CscWindows`); its crcs are computed as the
            arrays are written.
        digest: what determines the entries (`TableEngine.tile_digest`): the arrays go
            to `shared/csc-<digest>/`, replacing what an attempt killed before the
            first version left there (nothing references it: a store with a version
            has its CSC and precomputes nothing); None: a fresh folder.

    Raises:
        StoreError: a spill file reads back other than written, or the entries are
            not the ones the column pointer says.
    """

    def __init__(
        self,
        store: Store,
        param: str,
        schedule: AccessSchedule,
        order: np.ndarray,
        hot: int,
        dim: int,
        dtype: np.dtype[Any],
        window_steps: int,
        digest: str | None = None,
    ) -> None:
        self.store = store
        self.param = param
        self.col_ptr = expected_col_ptr(schedule, order, hot)
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.window_steps = window_steps
        self.entry_bytes = 16 + dim * self.dtype.itemsize
        self.nnz = int(self.col_ptr[-1])
        self._layout(schedule.rows, order, hot)
        buckets = self.buckets
        self._sizes = [0] * buckets
        self._crcs = [(0, 0)] * buckets
        backend = store.backend
        token = secrets.token_hex(4)
        if backend.local:
            self.spill = backend.path(shared_path(f"{PRECOMPUTE}/{param}/spill-{token}"))
            os.makedirs(self.spill, mode=0o700)
        else:
            self.spill = tempfile.mkdtemp(prefix="cocoon-csc-")
        self.folder = f"csc-{digest}" if digest is not None else token
        self.name = f"{self.folder}/{emb_name(param, 'csc')}"
        self.spilled_bytes = 0

    def _layout(self, rows: int, order: np.ndarray, hot: int) -> None:
        """Buckets by (column, row), the CSC's order: runs of whole windows of steps,
        each at least MIN_BUCKET_BYTES (but the last), then the tails (column n) in runs
        of cold rows no larger than the largest of those, so no bucket holds every cold
        row. Sets `_bounds` (each bucket's first key, column * R + row, and the end),
        `_want` (each bucket's entries) and `buckets`."""
        ptr = self.col_ptr
        n = ptr.size - 2
        starts = window_edges(n, self.window_steps) if n > 0 else np.zeros(1, np.int64)
        cols = [0]
        for c in starts[1:]:
            if (ptr[c] - ptr[cols[-1]]) * self.entry_bytes >= MIN_BUCKET_BYTES or c == n:
                cols.append(int(c))
        want = [int(ptr[b] - ptr[a]) for a, b in zip(cols[:-1], cols[1:], strict=True)]
        self._rows = rows
        bounds = [c * rows for c in cols[:-1]]
        cold = np.sort(order[hot:])
        piece = max([*want, MIN_BUCKET_BYTES // self.entry_bytes, 1])
        for k in range(0, cold.size, piece):
            bounds.append(n * rows + (int(cold[k]) if k else 0))
            want.append(min(piece, cold.size - k))
        bounds.append((n + 1) * rows if cold.size else n * rows)
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._want = want
        self.buckets = len(want)
        self._tails_from = len(cols) - 1  # the first bucket of the tails

    def _file(self, b: int, kind: str) -> str:
        return os.path.join(self.spill, f"{b:06d}.{kind}")

    def add(self, entries: TileEntries) -> None:
        """Spill one tile's entries ((E,) columns, (E,) rows, (E, dim) values) by
        bucket."""
        cols, rows, values = entries
        bucket = np.searchsorted(self._bounds, cols * self._rows + rows, side="right") - 1
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(self.buckets + 1))
        for b in range(self.buckets):
            lo, hi = int(bounds[b]), int(bounds[b + 1])
            if hi == lo:
                continue
            pick = order[lo:hi]
            pairs = np.ascontiguousarray(np.column_stack([cols[pick], rows[pick]]), np.int64)
            vals = np.ascontiguousarray(values[pick], dtype=self.dtype)
            ci, cv = self._crcs[b]
            ci = self._append(self._file(b, "idx"), pairs, ci)
            cv = self._append(self._file(b, "val"), vals, cv)
            self._crcs[b] = (ci, cv)
            self._sizes[b] += hi - lo
            self.spilled_bytes += pairs.nbytes + vals.nbytes

    @staticmethod
    def _append(path: str, arr: np.ndarray, crc: int) -> int:
        data = arr.reshape(-1).view(np.uint8).data
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        return crc32c.crc32c(data, crc)

    def _read(self, b: int, kind: str, shape: tuple[int, ...], dtype: Any, crc: int) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if out.size:
            with open(self._file(b, kind), "rb") as f:
                got = f.readinto(out.reshape(-1).view(np.uint8).data)
            if got != out.nbytes or crc32c.crc32c(out.reshape(-1).view(np.uint8).data) != crc:
                raise StoreError(
                    f"{self.store.url}: the precompute's spill {self._file(b, kind)} of table "
                    f"{self.param} reads back other than it was written; start the job again"
                )
        return out

    def finish(self) -> tuple[StoredCSC, dict[str, list[int]]]:
        """Sort every bucket into the store's `rows` and `values` (and write the
        column pointer); the CSC, not yet in a version, and its window crcs for
        `CscWindows`.

        Raises:
            StoreError: a spill fails its crc, or a column holds other entries than the
                schedule says (a tile missing or twice).
        """
        if sum(self._sizes) != self.nnz:
            raise StoreError(
                f"table {self.param}: the precompute gave {sum(self._sizes)} coalesced "
                f"entries, its schedule says {self.nnz}"
            )
        backend = self.store.backend
        backend.rm(shared_path(self.name), recursive=True)  # a killed attempt's
        ensure_groups(backend, SHARED, f"{self.name}/rows", {SHARED})
        byte_edges = window_layout(self.col_ptr, self.window_steps)[1]
        rows_out = _ArrayStream(self.store, f"{self.name}/rows", (self.nnz,), np.dtype(np.int64))
        vals_out = _ArrayStream(self.store, f"{self.name}/values", (self.nnz, self.dim), self.dtype)
        crcs = {
            "rows": WindowCrcs(byte_edges * 8),
            "values": WindowCrcs(byte_edges * self.dim * self.dtype.itemsize),
        }
        n = self.col_ptr.size - 2
        for b in range(self.buckets):
            size = self._sizes[b]
            ci, cv = self._crcs[b]
            pairs = self._read(b, "idx", (size, 2), np.int64, ci)
            vals = self._read(b, "val", (size, self.dim), self.dtype, cv)
            order = np.lexsort((pairs[:, 1], pairs[:, 0]))
            cols, rows = pairs[order, 0], np.ascontiguousarray(pairs[order, 1])
            del pairs
            vals = vals[order]
            if b < self._tails_from:  # columns [c0, c1): one entry per cold row read
                c0, c1 = (int(x) // self._rows for x in self._bounds[b : b + 2])
                want = np.diff(self.col_ptr[c0 : c1 + 1])
                ok = np.array_equal(np.bincount(cols - c0, minlength=c1 - c0), want)
                what = f"columns {c0}..{c1 - 1}"
            else:  # a run of the tails: one entry per cold row, each row once
                ok = size == self._want[b] and bool(np.all(cols == n))
                ok = ok and bool(np.all(np.diff(rows) > 0))
                what = f"tails (bucket {b})"
            if not ok:
                raise StoreError(
                    f"table {self.param}: the precompute's entries of its {what} are not one "
                    "per cold row read (a tile missing or twice); start the job again"
                )
            crcs["rows"].feed(rows_out.written * 8, rows)
            crcs["values"].feed(vals_out.written * vals_out.row_bytes, vals)
            rows_out.append(rows)
            vals_out.append(vals)
            if size:  # the bucket is in the store: its spill is done with
                os.remove(self._file(b, "idx"))
                os.remove(self._file(b, "val"))
        metas = {
            "rows": rows_out.close(),
            "values": vals_out.close(),
            "col_ptr": self.store.put_shared(f"{self.name}/col_ptr", self.col_ptr),
        }
        backend.fsync_tree(shared_path(self.name))
        stored = StoredCSC(self.store, None, self.param, metas, self.col_ptr)
        return stored, {k: c.crcs for k, c in crcs.items()}

    def close(self) -> None:
        """Remove the spill files."""
        shutil.rmtree(self.spill, ignore_errors=True)


class _ArrayStream:
    """A zarr v3 array under shared/ written chunk by chunk as its rows arrive, in
    `state.arrays`' layout (each chunk its C-order bytes padded to the full chunk, then
    their crc32c), with the whole array's checksum."""

    def __init__(self, store: Store, name: str, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self.store = store
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize
        # state.arrays' own rule, read when the array starts (as write_array reads it)
        rows = state_arrays.CHUNK_BYTES // max(self.row_bytes, 1)
        self.chunk_rows = max(1, min(shape[0], rows))
        self.chunks = (self.chunk_rows, *shape[1:])
        meta = array_metadata(shape, dtype, self.chunks, default_dimension_names(name, len(shape)))
        store.backend.write_staged(
            shared_path(f"{name}/zarr.json"), [json.dumps(meta).encode()], exclusive=True
        )
        self._buf = bytearray()
        self._index = 0
        self._crc = 0
        self.written = 0  # rows appended

    def append(self, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr, dtype=self.dtype).reshape(-1).view(np.uint8).data
        self.written += arr.shape[0]
        full = self.chunk_rows * self.row_bytes
        while data:
            take = min(full - len(self._buf), len(data))
            self._buf += data[:take]
            data = data[take:]
            if len(self._buf) == full:
                self._flush(full)

    def _flush(self, full: int) -> None:
        payload = bytes(self._buf)
        self._crc = crc32c.crc32c(payload, self._crc)
        pad = bytes(full - len(payload))
        crc = crc32c.crc32c(pad, crc32c.crc32c(payload))
        key = chunk_key(self._index, len(self.shape), CHUNK_SEPARATOR)
        self.store.backend.write_staged(
            shared_path(f"{self.name}/{key}"),
            [payload, pad, crc.to_bytes(4, "little")],
            exclusive=True,
        )
        self._index += 1
        self._buf = bytearray()

    def close(self) -> ArrayMeta:
        if self.written != self.shape[0]:
            raise StoreError(
                f"{self.name}: {self.written} rows were written, its shape says {self.shape[0]}"
            )
        if self._buf:
            self._flush(self.chunk_rows * self.row_bytes)
        return ArrayMeta(
            path=shared_path(self.name),
            shape=self.shape,
            dtype=str(self.dtype),
            checksum=f"crc32c:{self._crc:08x}",
            chunks=self.chunks,
            separator=CHUNK_SEPARATOR,
        )
