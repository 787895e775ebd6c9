"""Any other fsspec filesystem: object stores (s3://), memory://, wrappers (faulty://).

Writes are whole objects (one PUT each), so they are atomic and need no fsync; the
commit is a conditional PUT (`mode="create"`, If-None-Match on S3). There are no POSIX
modes: access is the bucket's or service's policy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import zarr.storage
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.abc.store import Store as ZarrStore

from .backend import Backend, Capabilities

__all__ = ["EXCLUSIVE_PROTOCOLS", "FsspecBackend"]

#: Protocols whose create-if-absent is known to be atomic and exclusive. A wrapping
#: filesystem says so of itself with `cocoon_exclusive_create = True`.
EXCLUSIVE_PROTOCOLS = frozenset({"file", "local", "memory", "s3", "s3a"})
_S3 = frozenset({"s3", "s3a"})


class FsspecBackend(Backend):
    """A store root on a non-local fsspec filesystem."""

    local = False

    def _capabilities(self) -> Capabilities:
        exclusive = bool(set(self.protocols) & EXCLUSIVE_PROTOCOLS) or bool(
            getattr(self.fs, "cocoon_exclusive_create", False)
        )
        return Capabilities(exclusive_create=exclusive, fsync=False, permissions=False)

    def replace(self, rel: str, data: bytes) -> None:
        """One PUT: object stores replace whole objects atomically."""
        self.retry.call(lambda: self.fs.pipe_file(self.path(rel), data))

    def makedirs(self, rel: str, *, private: bool = True) -> None:
        path = self.path(rel)
        self.retry.call(lambda: self.fs.makedirs(path, exist_ok=True))

    def write_staged(
        self, rel: str, parts: Sequence[bytes | memoryview], *, exclusive: bool
    ) -> None:
        """One PUT of the whole object, retried: rewriting a path no manifest references
        yet is idempotent. `exclusive` is not enforced: a retry after a lost response
        would refuse our own object."""
        data = b"".join(parts)
        self.retry.call(lambda: self.fs.pipe_file(self.path(rel), data))

    def write_once(self, rel: str, data: bytes, *, private: bool = False) -> None:
        """One PUT of the whole object (idempotent, so retried)."""
        self.retry.call(lambda: self.fs.pipe_file(self.path(rel), data))

    def _create_exclusive(
        self, rel: str, data: bytes, on_temp_durable: Callable[[], None] | None
    ) -> None:
        # One conditional PUT: there is no temp stage, so `on_temp_durable` never fires.
        self.fs.pipe_file(self.path(rel), data, mode="create")

    def fsync_tree(self, rel: str) -> None:
        """Nothing to do: an object is durable once its PUT returns."""

    def chmod_private(self, rel: str) -> None:
        """Nothing to do: access is the bucket's or service's policy, not a mode."""

    def zarr_store(self, rel: str) -> ZarrStore:
        if self.protocol in _S3:
            # zarr builds its own async s3fs from the URL: handing it our sync instance
            # breaks on event loops.
            url = self.url.rstrip("/") + (f"/{rel}" if rel else "")
            return zarr.storage.FsspecStore.from_url(url, storage_options=self.storage_options)
        fs = (
            self.fs
            if getattr(self.fs, "async_impl", False)
            else AsyncFileSystemWrapper(self.fs, asynchronous=True)
        )
        return zarr.storage.FsspecStore(fs, path=self.path(rel))
