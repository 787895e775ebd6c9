"""Reading one committed version back: every array confined, checked and verified."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import core_dtype, read_array, verify_array
from .errors import CorruptVersionError, UnsafePathError
from .manifest import ArrayMeta, Manifest
from .paths import array_group, unsafe_path_reason
from .process import available_memory

if TYPE_CHECKING:
    from collections.abc import Callable

    from .store import Store

__all__ = ["Version", "read_verified", "verify_streamed"]

_READ_THREADS = 8

#: Bytes of verified arrays a version keeps for reuse (a restore verifies every array,
#: then decodes them). Past it an array is verified by a streamed pass (`STREAM_BYTES`),
#: and read (and verified) when asked for: a version larger than RAM, a ring history on a far tier, is
#: verified and restored in bounded memory instead of held whole.
KEEP_BYTES = 1 << 30

#: Past `KEEP_BYTES`, a version whose restore reads its arrays whole still reads each of
#: them only once when memory allows: up to another `KEEP_BYTES` of them, and no more than
#: `1 / SPARE_SHARE` of the memory available when `Version.verify` starts, are read whole,
#: verified and held for one read (`Version.array` hands each over once and holds it no
#: longer); the rest are checked by a streamed pass and read again when asked for. At
#: 42M (1.28 GB, the last 320 MiB past `KEEP_BYTES`) that saves reading and crc'ing 320
#: MiB again; a hot restore measured 1.22 and 0.99 of reading them twice (medians of 6
#: alternating pairs, 2 runs: within what fresh memory and the order decide,
#: docs/benchmarks.md).
SPARE_SHARE = 8

#: Where its caller does not say which arrays it will read in pieces (`Version.verify`'s
#: `stream`), `Version.verify` checks an array larger than this (or one the `KEEP_BYTES`
#: it keeps would not hold) by a streamed pass, a piece at a time, instead of reading it
#: whole. The price: a restore reads such an array twice (a hot restore of 128 MiB
#: arrays took 1.1-1.9x the time of verifying them whole and keeping them), so a
#: resume names the arrays it reads in windows instead (`train.start`), and the rest
#: are read once and kept.
STREAM_BYTES = 64 << 20


class Version:
    """One committed version, read back. Arrays load on first access and are verified;
    up to `KEEP_BYTES` of them are kept for the next access."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self._cache: dict[str, np.ndarray] = {}
        self._kept = 0
        self._lent: dict[str, np.ndarray] = {}  # verified, held for one read
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def records(self) -> dict[str, Any]:
        return self.manifest.records

    def array_names(self) -> list[str]:
        return sorted(self.manifest.arrays)

    def array(self, name: str) -> np.ndarray:
        """The array `name`, checked against the manifest's shape, dtype and checksum (an
        array `verify` held for one read is handed over and no longer held).

        Raises:
            KeyError: the version has no array `name`.
            CorruptVersionError: it is missing, truncated or fails its checksum.
            UnsafePathError: its path leaves the store.
        """
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        with self._lock:
            lent = self._lent.pop(name, None)
        if lent is not None:
            return lent
        return self._load(name, None)

    def _load(self, name: str, out: np.ndarray | None) -> np.ndarray:
        """Read array `name` (into `out` if given), verified, and keep it if
        `KEEP_BYTES` holds it."""
        arr = read_verified(self.store, self.version, name, self.manifest.arrays[name], out)
        with self._lock:
            if name not in self._cache and self._kept + arr.nbytes <= KEEP_BYTES:
                self._cache[name] = arr
                self._kept += arr.nbytes
        return arr

    def verify(self, stream: Callable[[str], bool] | None = None) -> None:
        """Check every array (raises CorruptVersionError on the first bad one, in name
        order).

        Arrays are read whole and kept (up to `KEEP_BYTES`) for the restore that
        follows, except those `stream` names (by default those over `STREAM_BYTES`) and
        those the kept bytes would not hold. Of these last, those the memory allows
        (`SPARE_SHARE`) are read whole as well and held for one read; the rest are
        checked by a streamed pass that holds a piece of them at a time
        (`verify_streamed`), the same checks with the same verdicts, and read whole only
        if `array` is asked for them. Arrays are checked by a few threads at once: file
        reads and crc32c release the GIL, and a cold restore is bound by read latency,
        which overlapping hides. The arrays read whole are allocated here, on the
        caller's thread, once the plan has bounded them: allocated on a pool thread, a
        large array comes from a fresh mapping (glibc's thread arenas grow by 64 MiB
        heaps at most), never from memory the process freed before, and each of its
        pages faults in again (`state.arrays.read_array`'s `out`).
        """
        names = self.array_names()
        planned = self._kept
        spare = min(KEEP_BYTES, available_memory() // SPARE_SHARE)  # bound before allocating
        streamed: set[str] = set()
        lent: set[str] = set()
        for n in names:
            size = _nbytes(self.manifest.arrays[n])
            if n in self._cache or n in self._lent:
                continue
            named = size > STREAM_BYTES if stream is None else stream(n)
            if named:
                streamed.add(n)
            elif planned + size <= KEEP_BYTES:
                planned += size
            elif size <= spare:
                spare -= size
                lent.add(n)
            else:
                streamed.add(n)
        todo = [n for n in names if n not in self._cache and n not in self._lent]
        into = {n: _buffer(self.manifest.arrays[n]) for n in todo if n not in streamed}
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            futures = [
                pool.submit(self._check, n, n in streamed, n in lent, into.get(n)) for n in todo
            ]
        for fut in futures:
            fut.result()

    def _check(self, name: str, stream: bool, lend: bool, out: np.ndarray | None) -> None:
        """Verify array `name`: by a streamed pass (`stream`; whole where only zarr reads
        it), or read whole (into `out` if given) and kept or, with `lend`, held for one
        read."""
        meta = self.manifest.arrays[name]
        if lend:
            arr = read_verified(self.store, self.version, name, meta, out)
            with self._lock:
                self._lent[name] = arr
        elif not stream or not verify_streamed(self.store, self.version, name, meta):
            self._load(name, out)

    def __repr__(self) -> str:
        return f"Version({self.version}, step={self.step}, arrays={len(self.manifest.arrays)})"


def read_verified(
    store: Store, version: int, name: str, meta: ArrayMeta, out: np.ndarray | None = None
) -> np.ndarray:
    """Array `name` of version `version` as `meta` describes it, confined and verified.

    Args:
        out: the array to read it into (`_buffer(meta)`), or None to allocate one here.

    Raises:
        UnsafePathError: `meta.path` leaves the store.
        CorruptVersionError: the array is missing, torn, of another shape or dtype, or
            fails its checksum.
    """
    where = f"version {version} of {store.url}: array {meta.path}"
    check_confined(store, version, name, meta)
    group, sub = array_group(meta.path)
    try:
        layout = None if meta.chunks is None else (meta.shape, meta.dtype, meta.chunks)
        arr, got = store.retry.call(
            lambda: read_array(store.backend, group, sub, layout, meta.separator, out)
        )
    except Exception as exc:  # zarr raises many kinds for a missing/torn chunk
        raise CorruptVersionError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); it is missing or torn",
            version=version,
            path=meta.path,
        ) from exc
    if tuple(arr.shape) != meta.shape or str(arr.dtype) != meta.dtype:
        raise CorruptVersionError(
            f"{where} is {arr.dtype}{list(arr.shape)}, manifest says {meta.dtype}{list(meta.shape)}",
            version=version,
            path=meta.path,
        )
    _check_checksum(where, got, meta, version)
    return arr


def verify_streamed(store: Store, version: int, name: str, meta: ArrayMeta) -> bool:
    """`read_verified`'s checks of array `name`, streamed (`state.arrays.verify_array`):
    confined, every chunk's crc32c and the whole array's checksum, with the same
    errors, holding a piece of the array at a time.

    Returns:
        False for an array in a layout only zarr reads (nothing checked: read it with
        `read_verified`), True once it is checked.

    Raises:
        UnsafePathError: `meta.path` leaves the store.
        CorruptVersionError: the array is missing, torn, or fails its checksum.
    """
    where = f"version {version} of {store.url}: array {meta.path}"
    check_confined(store, version, name, meta)
    group, sub = array_group(meta.path)
    try:
        layout = None if meta.chunks is None else (meta.shape, meta.dtype, meta.chunks)
        got = store.retry.call(
            lambda: verify_array(store.backend, group, sub, layout, meta.separator)
        )
    except Exception as exc:  # zarr.json may be missing or not JSON, as for read_array
        raise CorruptVersionError(
            f"{where} cannot be read ({type(exc).__name__}: {exc}); it is missing or torn",
            version=version,
            path=meta.path,
        ) from exc
    if got is None:
        return False
    _check_checksum(where, got, meta, version)
    return True


def _check_checksum(where: str, got: str, meta: ArrayMeta, version: int) -> None:
    """Raise CorruptVersionError unless `got` is the checksum `meta` records (the whole
    read's and the streamed check's one message)."""
    if got != meta.checksum:
        raise CorruptVersionError(
            f"{where} checksum mismatch ({got} != {meta.checksum})",
            version=version,
            path=meta.path,
        )


def _buffer(meta: ArrayMeta) -> np.ndarray | None:
    """An uninitialised array to read array `meta` into, or None where its read
    allocates its own: no chunk shape recorded (zarr.json decides how it is read), or a
    dtype that is not one of the zarr v3 core types or a shape numpy refuses (reading
    it reports either)."""
    dtype = core_dtype(meta.dtype)
    if meta.chunks is None or dtype is None:
        return None
    try:
        return np.empty(meta.shape, dtype=dtype)
    except ValueError:  # a negative or absurd shape: reading it reports it
        return None


def _nbytes(meta: ArrayMeta) -> int:
    """What array `meta` takes in memory (0 for a dtype numpy does not know: reading
    it reports it)."""
    try:
        return math.prod(meta.shape) * np.dtype(meta.dtype).itemsize
    except TypeError:
        return 0


def check_confined(store: Store, version: int, name: str, meta: ArrayMeta) -> None:
    """Refuse an array path that leaves the store: by its form (every backend), and
    on local disk by where its folder and every link inside it resolve.

    Raises:
        UnsafePathError: naming the version, the array and the path.
    """

    def refuse(reason: str) -> UnsafePathError:
        return UnsafePathError(
            f"version {version} of {store.url}: array {name!r} has path {meta.path!r}, "
            f"which {reason}; a manifest may name only arrays inside its own store, so "
            "this version is refused",
            version=version,
            path=meta.path,
            array=name,
        )

    reason = unsafe_path_reason(meta.path)
    if reason is not None:
        raise refuse(reason)
    escaped = store.backend.escaping_link(meta.path)
    if escaped is not None:
        raise refuse(f"resolves outside the store root through {escaped}")
