"""Where a conformance run puts its stores, and how it damages them at rest."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec

from ..backend import Backend
from ..open import open_backend
from ..store import Store

__all__ = [
    "LocationFactory",
    "StoreLocation",
    "flip_bit",
    "local_locations",
    "memory_locations",
    "open_store",
    "restore",
    "s3_locations",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreLocation:
    """A fresh, empty place for one store: what `Store.open` takes."""

    url: str
    """Local path or fsspec URL."""
    storage_options: dict[str, Any] | None = None
    """fsspec options (an S3 endpoint and credentials)."""
    fs: fsspec.AbstractFileSystem | None = field(default=None, compare=False)
    """A filesystem instance to open it through (a fault-injecting wrapper)."""


#: Makes a new empty location on each call (each state machine run needs its own).
LocationFactory = Callable[[], StoreLocation]


def open_store(loc: StoreLocation, *, create: bool = True) -> Store:
    """`Store.open` at `loc`."""
    return Store.open(loc.url, storage_options=loc.storage_options, create=create, fs=loc.fs)


def backend_of(loc: StoreLocation, *, fresh: bool = False) -> Backend:
    """A backend at `loc` (for writing what a store would not: foreign files, damage).

    Args:
        fresh: through a filesystem instance of its own, with caches of its own, as
            another process would see the location (fsspec shares one instance per
            protocol and options within a process).
    """
    fs = loc.fs
    if fresh and fs is None:
        cls = type(open_backend(loc.url, loc.storage_options).fs)
        fs = cls(skip_instance_cache=True, **(loc.storage_options or {}))
        return open_backend(loc.url, loc.storage_options, fs=fs)
    return open_backend(loc.url, loc.storage_options, fs=fs)


def local_locations(root: Path) -> LocationFactory:
    """Fresh folders under `root` (a pytest `tmp_path`)."""
    return lambda: StoreLocation(url=str(root / f"store-{uuid.uuid4().hex[:12]}.zarr"))


def memory_locations() -> LocationFactory:
    """Fresh `memory://` locations (fsspec's process-wide memory filesystem)."""
    return lambda: StoreLocation(url=f"memory://conformance-{uuid.uuid4().hex}")


def s3_locations(bucket: str, storage_options: dict[str, Any]) -> LocationFactory:
    """Fresh prefixes in an existing S3 `bucket` (a local moto server in tests)."""
    return lambda: StoreLocation(
        url=f"s3://{bucket}/{uuid.uuid4().hex}.zarr", storage_options=storage_options
    )


def flip_bit(store: Store, rel: str, bit: int) -> bytes:
    """Flip bit `bit` (modulo the file's size) of store file `rel` at rest, as a bad
    sector would; returns the original bytes, for `restore`."""
    backend = store.backend
    data = backend.read_bytes(rel)
    damaged = bytearray(data)
    bit %= len(damaged) * 8
    damaged[bit // 8] ^= 1 << (bit % 8)
    _overwrite(backend, rel, bytes(damaged))
    return data


def restore(store: Store, rel: str, data: bytes) -> None:
    """Put back the bytes `flip_bit` returned."""
    _overwrite(store.backend, rel, data)


def _overwrite(backend: Backend, rel: str, data: bytes) -> None:
    # A raw overwrite, below the store (which never rewrites a file); retried, as a
    # fault-injecting filesystem may fail it transiently.
    backend.invalidate(rel)
    backend.retry.call(lambda: backend.fs.pipe_file(backend.path(rel), data))
    backend.invalidate(rel)
