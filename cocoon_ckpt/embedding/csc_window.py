"""A committed CSC read from the store in windows of steps, so a table's coalesced noise
need not fit in host memory (`EmbeddingConfig.csc_window_steps`).

Window w holds the columns [w W, (w + 1) W) of the CSC (the tails, column n, are in the
last window): a contiguous run of its entries, because the entries are sorted by
column. While step t uses its window, a background thread reads the next one, so at
most two windows are resident: the current one and the next.

What is verified, and when. `CscWindows` first streams every chunk of the stored
`rows` and `values` once, a piece in memory at a time (`state.arrays.verify_array`,
the pass `state.Version.verify` makes over a large array): each chunk's crc32c and the
whole array's checksum against the manifest, what the whole-CSC path checks
(`state.Version.array`). In the same pass it records the crc32c of every window's
bytes; a window read later is checked against that crc before any of it is used, so a
byte changed in the store after the open is caught, never applied. A CSC the job
itself computed and committed is not read back: its window crcs come from the arrays
in memory, after their checksum is found equal to the committed one, and the windows
read back from the store are then checked against them.

The windows never change the bits: every column is the same (rows, values) as the
whole CSC's, applied in the same order (tests/cocoon_ckpt/test_csc_window.py).
"""

from __future__ import annotations

import functools
import math
import os
import stat
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import numpy as np

from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.layout import csc_array, emb_name
from state import (
    ArrayMeta,
    CorruptVersionError,
    Manifest,
    Store,
    StoreError,
    Version,
    array_checksum,
)
from state.arrays import chunk_key, verify_array
from state.paths import array_group
from state.version import check_confined

__all__ = [
    "CSC_PARTS",
    "CscWindows",
    "StoredCSC",
    "WindowCrcs",
    "damaged",
    "read_in_windows",
    "verify_part",
    "window_edges",
    "window_layout",
]

#: A CSC's arrays, by their name under `emb/<param>/csc/`.
CSC_PARTS = ("col_ptr", "rows", "values")


@dataclass(frozen=True, slots=True)
class StoredCSC:
    """A CSC committed in a version, not read yet: its arrays' manifest entries and its
    column pointer (small, read and verified), from which the rest is bounded.

    Attributes:
        store: the store holding it.
        manifest: the committed version that names it (None: written by this job's
            precompute, `embedding.csc_assembly`, for its first version to reference).
        param: the table's parameter name.
        metas: the manifest entries of `col_ptr`, `rows` and `values`.
        col_ptr: (n+2,) int64, verified against the manifest.
    """

    store: Store
    manifest: Manifest | None
    param: str
    metas: dict[str, ArrayMeta]
    col_ptr: np.ndarray

    @classmethod
    def of_version(cls, version: Version, param: str) -> StoredCSC:
        """Table `param`'s CSC in `version`, its layout checked against its column pointer.

        Raises:
            KeyError: the version holds no CSC for `param`.
            CorruptVersionError: the column pointer fails its checksum, or the arrays'
                shapes disagree with it.
        """
        return cls.of_arrays(version, param, {k: emb_name(param, f"csc/{k}") for k in CSC_PARTS})

    @classmethod
    def of_arrays(cls, version: Version, param: str, names: dict[str, str]) -> StoredCSC:
        """`of_version` of the CSC whose `col_ptr`, `rows` and `values` `version` holds
        under `names` (a rank's part: `embedding.csc_shards.part_name`)."""
        metas = {k: version.manifest.arrays[names[k]] for k in CSC_PARTS}
        ptr = np.asarray(version.array(names["col_ptr"]))
        rows, values = metas["rows"], metas["values"]
        nnz = int(ptr[-1]) if ptr.ndim == 1 and ptr.size else -1
        bad = None
        if ptr.ndim != 1 or ptr.size < 2 or ptr[0] != 0 or np.any(np.diff(ptr) < 0):
            bad = "its col_ptr is not a valid column pointer"
        elif rows.shape != (nnz,) or rows.dtype != "int64":
            bad = f"its rows are {rows.dtype}{list(rows.shape)}, col_ptr says int64[{nnz}]"
        elif len(values.shape) != 2 or values.shape[0] != nnz:
            bad = f"its values are {list(values.shape)}, col_ptr says {nnz} entries"
        if bad is not None:
            raise CorruptVersionError(
                f"version {version.version} of {version.store.url}: the CSC of table "
                f"{param}: {bad}",
                version=version.version,
                path=metas["col_ptr"].path,
            )
        return cls(version.store, version.manifest, param, metas, ptr)

    @property
    def version(self) -> int | None:
        return None if self.manifest is None else self.manifest.version

    @property
    def where(self) -> str:
        """Where it lies, for messages."""
        of = "not yet in a version" if self.manifest is None else f"version {self.version}"
        return f"{of} of {self.store.url}"

    @property
    def steps(self) -> int:
        return int(self.col_ptr.size) - 2

    @property
    def nnz(self) -> int:
        return int(self.col_ptr[-1])

    @property
    def dim(self) -> int:
        return int(self.metas["values"].shape[1])

    @property
    def nbytes(self) -> int:
        """What the whole CSC takes in memory."""
        return sum(math.prod(m.shape) * np.dtype(m.dtype).itemsize for m in self.metas.values())

    def load(self) -> CoalescedCSC:
        """The whole CSC in memory, each array verified against the manifest.

        Raises:
            ValueError: it is not in a committed version yet.
        """
        if self.manifest is None:
            raise ValueError(f"the CSC of table {self.param} is {self.where}: read it in windows")
        version = Version(self.store, self.manifest)
        return CoalescedCSC.from_arrays(
            {k: version.array(emb_name(self.param, f"csc/{k}")) for k in CSC_PARTS}
        )


#: The tails are read in pieces of at least this many entries (or the largest window).
TAIL_PIECE_MIN = 4096


def window_edges(columns: int, window_steps: int) -> np.ndarray:
    """(windows + 1,) int64: the first column of each window of `window_steps`
    columns over `columns` columns, and `columns`."""
    windows = max(1, -(-columns // window_steps))
    return np.minimum(np.arange(windows + 1, dtype=np.int64) * window_steps, columns)


def window_layout(col_ptr: np.ndarray, window_steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows of a CSC: steps 0..n-1 in windows of `window_steps` columns, then
    the tails (column n, one entry per cold row) in pieces no larger than the largest
    of those (at least `TAIL_PIECE_MIN` entries), so no window holds every cold row.

    Returns:
        (windows,) int64 the first column of each window (n for a piece of the
        tails), and (windows + 1,) int64 the entry offset where each starts, and nnz.
    """
    ptr = np.asarray(col_ptr, dtype=np.int64)
    n = ptr.size - 2
    cols = window_edges(n, window_steps) if n > 0 else np.zeros(1, np.int64)
    edges = ptr[cols]
    largest = int(np.diff(edges).max(initial=0))
    piece = max(largest, TAIL_PIECE_MIN)
    tails = int(ptr[n + 1] - ptr[n])
    pieces = max(1, -(-tails // piece))
    tail_edges = int(ptr[n]) + np.minimum(np.arange(1, pieces + 1) * piece, tails)
    return (
        np.concatenate([cols[:-1], np.full(pieces, n)]).astype(np.int64),
        np.concatenate([edges, tail_edges]).astype(np.int64),
    )


class WindowCrcs:
    """The crc32c of each window's bytes of one array, fed its bytes in order.

    Args:
        edges: (windows + 1,) the byte offset of each window's start, and the end.
    """

    def __init__(self, edges: np.ndarray) -> None:
        self.edges = np.asarray(edges, dtype=np.int64)
        self.crcs = [0] * (self.edges.size - 1)

    def feed(self, offset: int, data: np.ndarray | memoryview | bytes) -> None:
        """The array's bytes [offset, offset + len(data))."""
        view = memoryview(data).cast("B") if not isinstance(data, np.ndarray) else None
        if view is None:
            view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        end = offset + len(view)
        first = max(int(np.searchsorted(self.edges, offset, side="right")) - 1, 0)
        for w in range(first, len(self.crcs)):
            a, z = max(int(self.edges[w]), offset), min(int(self.edges[w + 1]), end)
            if a >= end:
                break
            if z > a:
                self.crcs[w] = crc32c.crc32c(view[a - offset : z - offset], self.crcs[w])


def damaged(stored: StoredCSC, path: str, what: str) -> StoreError:
    """The error for a CSC whose bytes are not what was written: a damaged version
    (`CorruptVersionError`), or this job's own CSC not yet in one."""
    if stored.version is None:
        return StoreError(
            f"{stored.where}: {what}; the precompute's CSC is damaged: start the job again"
        )
    return CorruptVersionError(
        f"{stored.where}: {what}; it is damaged (resume with --allow-fallback to use an "
        "older version)",
        version=stored.version,
        path=path,
    )


@dataclass(frozen=True, slots=True)
class _Window:
    """Window `index` of a CSC: its entries [base, base + rows.size)."""

    index: int
    base: int
    rows: np.ndarray
    values: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes + self.values.nbytes)


class CscWindows:
    """A committed CSC, column by column, read in windows of `window_steps` columns
    with the next window prefetched: at most two windows in memory.

    Columns are best asked for in increasing order (as steps take them); any other
    order is answered too, by reading its window at once.

    Args:
        stored: the committed CSC.
        window_steps: columns per window, >= 1.
        like: the same CSC in memory, when this process computed it: its window crcs
            are taken from it (its checksums must equal the committed ones) instead of
            a pass over the store.
        crcs: the window crcs of `rows` and `values`, from whoever wrote them
            (`embedding.csc_assembly`), instead of a pass over the store.

    Attributes:
        resident_bytes: bytes of window arrays held now (current and prefetched).
        peak_resident_bytes: the most ever held at once.
        windows_read: windows read from the store so far.

    Raises:
        ValueError: `window_steps` < 1, or the stored arrays are not in the chunk layout
            this reader knows (written before chunk shapes were recorded).
        CorruptVersionError: a chunk or a whole array fails its checksum, or `like` is
            not the committed CSC.
    """

    def __init__(
        self,
        stored: StoredCSC,
        window_steps: int,
        like: CoalescedCSC | None = None,
        crcs: dict[str, list[int]] | None = None,
    ) -> None:
        if window_steps < 1:
            raise ValueError(f"csc_window_steps={window_steps}: give 1 or more steps")
        self.stored = stored
        self.metas = stored.metas
        self.window_steps = window_steps
        self.col_ptr = stored.col_ptr
        self.steps = stored.steps
        self.nnz = stored.nnz
        self.nbytes = stored.nbytes
        self._wcols, self._edges = window_layout(self.col_ptr, window_steps)
        self.windows = int(self._wcols.size)
        self._first_tail = int(np.searchsorted(self._wcols, self.steps))
        self._arrays = {k: _ArrayReader(stored, k) for k in ("rows", "values")}
        if crcs is not None:
            if any(len(crcs[k]) != self.windows for k in self._arrays):
                raise ValueError(f"crcs of {len(crcs['rows'])} windows, not {self.windows}")
            self._crcs = {k: list(crcs[k]) for k in self._arrays}
        elif like is None:
            self._crcs = {k: a.verify(self._edges * a.row_bytes) for k, a in self._arrays.items()}
        else:
            self._crcs = {k: self._crcs_of(k, like) for k in self._arrays}
        self._lock = threading.Lock()
        self.resident_bytes = 0
        self.peak_resident_bytes = 0
        self.windows_read = 0
        self._current: _Window | None = None
        self._next: Future[_Window] | None = None
        self._next_index = -1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="cocoon-csc")

    def _crcs_of(self, name: str, like: CoalescedCSC) -> list[int]:
        arr = like.rows if name == "rows" else like.values
        meta = self.metas[name]
        if tuple(arr.shape) != meta.shape or array_checksum(arr) != meta.checksum:
            raise damaged(
                self.stored,
                meta.path,
                f"CSC {name} of table {self.stored.param} is not the one this job computed",
            )
        out = WindowCrcs(self._edges * (math.prod(arr.shape[1:]) * arr.dtype.itemsize))
        out.feed(0, arr)
        return out.crcs

    def column(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values) applied before step t (t = steps: the tails), as the whole CSC
        gives them. The tails of a CSC whose tails are in several pieces are gathered
        whole: apply them with `tail_pieces`, which holds one piece at a time."""
        if not 0 <= t <= self.steps:
            raise IndexError(f"column {t} of a CSC of {self.steps} steps (0..{self.steps})")
        if t == self.steps and self.windows - self._first_tail > 1:
            pieces = list(self.tail_pieces())
            return np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])
        cur = self._switch(int(np.searchsorted(self._wcols, t, side="right")) - 1)
        lo, hi = int(self.col_ptr[t]) - cur.base, int(self.col_ptr[t + 1]) - cur.base
        return cur.rows[lo:hi], cur.values[lo:hi]

    def tail_pieces(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The tails (column n) as (rows, values) pieces of at most a window each, in
        row order: one after another they are column n, whose rows are distinct, so
        applying them in turn adds what applying the column at once adds."""
        for w in range(self._first_tail, self.windows):
            cur = self._switch(w)
            yield cur.rows, cur.values

    def _switch(self, w: int) -> _Window:
        """Window w made the current one, and the next one prefetched."""
        cur = self._current
        if cur is None or cur.index != w:
            self._release(cur)
            self._current = None
            cur = self._take(w)
            self._current = cur
            if w + 1 < self.windows:
                self._prefetch(w + 1)
        return cur

    def _take(self, w: int) -> _Window:
        fut, self._next = self._next, None
        if fut is not None:
            got = fut.result()  # raises a failed read here, in the step that needs it
            if self._next_index == w:
                return got
            self._release(got)
        return self._read(w)

    def _prefetch(self, w: int) -> None:
        self._next_index = w
        self._next = self._pool.submit(self._read, w)

    def _read(self, w: int) -> _Window:
        lo, hi = int(self._edges[w]), int(self._edges[w + 1])
        got = {k: a.read(lo, hi, self._crcs[k][w], w) for k, a in self._arrays.items()}
        win = _Window(w, lo, got["rows"], got["values"])
        with self._lock:
            self.resident_bytes += win.nbytes
            self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
            self.windows_read += 1
        return win

    def _release(self, win: _Window | None) -> None:
        if win is not None:
            with self._lock:
                self.resident_bytes -= win.nbytes

    def max_window_bytes(self) -> int:
        """The bytes of the largest window (rows and values)."""
        row = self.stored.dim * np.dtype(self.metas["values"].dtype).itemsize + 8
        return int(np.diff(self._edges).max(initial=0)) * row

    def close(self) -> None:
        """Stop the prefetch thread and drop the windows."""
        self._pool.shutdown(wait=True)
        if self._next is not None and self._next.done() and self._next.exception() is None:
            self._release(self._next.result())
        self._next = None
        self._release(self._current)
        self._current = None


def verify_part(version: Version, param: str, name: str) -> None:
    """Array `name` (`rows` or `values`) of table `param`'s CSC in `version`, checked as
    `CscWindows` checks it on open: every chunk's crc32c and the whole array's checksum
    against the manifest, a piece in memory at a time (how the tools verify a CSC
    without holding it).

    Raises:
        KeyError: the version holds no such array.
        ValueError: it has no recorded chunk shape (read it whole).
        CorruptVersionError: a chunk or the whole array fails its checksum.
    """
    meta = version.manifest.arrays[emb_name(param, f"csc/{name}")]
    # one pass over one array needs neither the other arrays nor the column pointer
    stored = StoredCSC(version.store, version.manifest, param, {name: meta}, np.zeros(2, np.int64))
    reader = _ArrayReader(stored, name)
    reader.verify(np.array([0, meta.shape[0] * reader.row_bytes], dtype=np.int64))


class _ArrayReader:
    """Element ranges of one stored CSC array (`rows` or `values`), along axis 0, read
    chunk-file by chunk-file (`state.arrays`'s layout: each chunk the C-order bytes,
    padded to the full chunk, then their crc32c)."""

    def __init__(self, stored: StoredCSC, name: str) -> None:
        meta = stored.metas[name]
        if meta.chunks is None:
            raise ValueError(
                f"{stored.store.url}: the CSC {name} of table {stored.param} has no recorded "
                "chunk shape (a store written before it was recorded); read it whole "
                "(csc_window_steps=None)"
            )
        self.store = stored.store
        self.meta = meta
        self.name = f"emb/{stored.param}/csc/{name}"
        self.dtype = np.dtype(meta.dtype)
        self.shape = meta.shape
        self.row_bytes = math.prod(meta.shape[1:]) * self.dtype.itemsize
        self.chunk_rows = int(meta.chunks[0])
        self.layout = (meta.shape, meta.dtype, meta.chunks)
        self.stored_len = self.chunk_rows * self.row_bytes
        self.chunks = -(-meta.shape[0] // self.chunk_rows) if meta.shape[0] else 0
        self.stored = stored
        if stored.version is not None:  # one of ours otherwise: written by this job
            check_confined(self.store, stored.version, self.name, meta)

    def _rel(self, i: int) -> str:
        return f"{self.meta.path}/{chunk_key(i, len(self.shape), self.meta.separator)}"

    def _corrupt(self, what: str) -> StoreError:
        return damaged(self.stored, self.meta.path, f"array {self.meta.path} {what}")

    def verify(self, edges: np.ndarray) -> list[int]:
        """Check every chunk and the whole array's checksum, a piece in memory at a
        time (`state.arrays.verify_array`, what `Version.verify` streams); the crc32c
        of each window's bytes (`edges`: byte offsets, `WindowCrcs`)."""
        group, sub = array_group(self.meta.path)

        def attempt() -> tuple[WindowCrcs, str | None]:
            crcs = WindowCrcs(edges)  # afresh on each try: a retried pass feeds it again
            got = verify_array(
                self.store.backend, group, sub, self.layout, self.meta.separator, crcs.feed
            )
            return crcs, got

        try:
            crcs, whole = self.store.retry.call(attempt)
        except (OSError, ValueError) as exc:
            # worded as a whole read words it (`state.version.read_verified`)
            raise self._corrupt(
                f"cannot be read ({type(exc).__name__}: {exc}); it is missing or torn"
            ) from exc
        if whole != self.meta.checksum:
            raise self._corrupt(f"fails its checksum (the manifest says {self.meta.checksum})")
        return crcs.crcs

    def read(self, lo: int, hi: int, want: int, window: int) -> np.ndarray:
        """Elements [lo, hi) along axis 0, checked against `want`, their crc32c."""
        out = np.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        at = 0
        for i in range(lo // self.chunk_rows, -(-hi // self.chunk_rows)) if hi > lo else ():
            a = max(lo, i * self.chunk_rows) - i * self.chunk_rows
            z = min(hi, (i + 1) * self.chunk_rows) - i * self.chunk_rows
            size = (z - a) * self.row_bytes
            part = self.store.retry.call(functools.partial(self._range, i, a, size))
            flat[at : at + size] = np.frombuffer(part, dtype=np.uint8)
            at += size
        got = crc32c.crc32c(flat.data) if flat.size else 0
        if got != want:
            raise self._corrupt(
                f"window {window} (entries {lo}..{hi}) changed since it was verified"
            )
        return out

    def _range(self, i: int, row: int, size: int) -> bytes:
        """`size` bytes of chunk i's payload from its row `row`."""
        backend = self.store.backend
        offset = row * self.row_bytes
        if not backend.local:  # a ranged read (an HTTP Range GET on an object store)
            end = offset + size
            data = backend.fs.cat_file(backend.path(self._rel(i)), start=offset, end=end)
            if len(data) != size:
                raise self._corrupt(f"chunk {i} is short")
            return bytes(data)
        path = backend.path(self._rel(i))
        if not os.path.realpath(path).startswith(os.path.realpath(backend.root) + os.sep):
            raise self._corrupt(f"chunk {i} resolves outside the store")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.stored_len + 4:
                raise self._corrupt(f"chunk {i} is not the file it was")
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise self._corrupt(f"chunk {i} is short")
        return data


def read_in_windows(name: str) -> bool:
    """Whether a job whose CSC is read in windows reads version array `name` in
    windows, never whole: a CSC's `rows` and `values` (`emb/<param>/csc/...`, a rank's
    part `emb/<param>/csc/slots-<a>-<b>/...` included). A resume's verification
    streams these (`state.version.Version.verify`) and reads every other array once."""
    parsed = csc_array(name)
    return parsed is not None and parsed[2] in CSC_PARTS[1:]
