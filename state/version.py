"""Reading one committed version back: every array confined, checked and verified."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from .arrays import read_array
from .errors import CorruptVersionError, UnsafePathError
from .manifest import ArrayMeta, Manifest
from .paths import array_group, unsafe_path_reason

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Version", "read_verified"]

_READ_THREADS = 8

#: Bytes of verified arrays a version keeps for reuse (a restore verifies every array,
#: then decodes them). Past it an array is verified and let go, and read (and verified)
#: again when asked for: a version larger than RAM, a ring history on a far tier, is
#: verified and restored in bounded memory instead of held whole.
KEEP_BYTES = 1 << 30


class Version:
    """One committed version, read back. Arrays load on first access and are verified;
    up to `KEEP_BYTES` of them are kept for the next access."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self._cache: dict[str, np.ndarray] = {}
        self._kept = 0
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
        """The array `name`, checked against the manifest's shape, dtype and checksum.

        Raises:
            KeyError: the version has no array `name`.
            CorruptVersionError: it is missing, truncated or fails its checksum.
            UnsafePathError: its path leaves the store.
        """
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        meta = self.manifest.arrays[name]
        arr = read_verified(self.store, self.version, name, meta)
        with self._lock:
            if name not in self._cache and self._kept + arr.nbytes <= KEEP_BYTES:
                self._cache[name] = arr
                self._kept += arr.nbytes
        return arr

    def verify(self) -> None:
        """Read and check every array (raises CorruptVersionError on the first bad one,
        in name order).

        Arrays are read by a few threads at once: file reads and crc32c release the
        GIL, and a cold restore is bound by read latency, which overlapping hides.
        """
        names = self.array_names()
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            futures = [pool.submit(self.array, n) for n in names]
        for fut in futures:
            fut.result()

    def __repr__(self) -> str:
        return f"Version({self.version}, step={self.step}, arrays={len(self.manifest.arrays)})"


def read_verified(store: Store, version: int, name: str, meta: ArrayMeta) -> np.ndarray:
    """Array `name` of version `version` as `meta` describes it, confined and verified.

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
            lambda: read_array(store.backend, group, sub, layout, meta.separator)
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
    if got != meta.checksum:
        raise CorruptVersionError(
            f"{where} checksum mismatch ({got} != {meta.checksum})",
            version=version,
            path=meta.path,
        )
    return arr


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
