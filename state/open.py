"""Which backend serves a URL: `LocalBackend` for local paths and `file://`,
`FsspecBackend` for every other fsspec filesystem. The dispatch sits above the
`Backend` contract and imports both implementations, so the contract knows none of
them (zarr keeps `make_store_path` above `abc.store` the same way)."""

from __future__ import annotations

from typing import Any

import fsspec

from .backend import Backend, fs_protocols, url_filesystem
from .fsspec_backend import FsspecBackend
from .local_backend import LocalBackend
from .retry import RetryPolicy

__all__ = ["LOCAL_PROTOCOLS", "open_backend"]

#: Protocols served by `LocalBackend`.
LOCAL_PROTOCOLS = frozenset({"file", "local"})


def open_backend(
    url: str,
    storage_options: dict[str, Any] | None = None,
    *,
    fs: fsspec.AbstractFileSystem | None = None,
    retry: RetryPolicy | None = None,
) -> Backend:
    """The backend for `url`: `LocalBackend` for local paths and `file://`,
    `FsspecBackend` for every other fsspec filesystem (memory://, s3://, faulty://).

    Args:
        url: a local path, `file://`, `memory://`, `s3://`, or any fsspec URL.
        storage_options: passed to fsspec (and to zarr for its own async filesystem).
        fs: an already built filesystem to use instead of resolving `url`'s protocol
            (the fault injector's wrapper); `url` then names the path inside it.
        retry: policy for transient errors of idempotent operations.
    """
    resolved, _ = url_filesystem(url, dict(storage_options or {}), fs)
    local = bool(set(fs_protocols(resolved)) & LOCAL_PROTOCOLS)
    cls: type[Backend] = LocalBackend if local else FsspecBackend
    return cls(url, storage_options, fs=fs, retry=retry)
