"""One storage location behind an fsspec URL, with the capabilities the commit needs.

The commit point of a version is the exclusive creation of its manifest, so a backend
must offer create-if-absent: local disk does it with temp file + fsync + `os.link`
(link fails if the target exists; rename would silently overwrite), object stores with
one conditional PUT (`pipe_file(..., mode="create")`, If-None-Match on S3). fsspec's
rename on object stores is copy + delete and is never used for a commit.

`Backend` is the contract and what every backend shares (retried reads through
fsspec, the guarded exclusive create); `LocalBackend` (state.local_backend) and
`FsspecBackend` (state.fsspec_backend) implement the writes; `state.open.open_backend`
picks one from the URL's filesystem, above this contract (as zarr keeps its URL dispatch
above `abc.store`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from zarr.abc.store import Store as ZarrStore

from .errors import StoreError
from .retry import RetryPolicy

__all__ = ["Backend", "Capabilities", "fs_protocols", "url_filesystem"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a backend can do; the commit protocol is chosen from these flags.

    Attributes:
        exclusive_create: Create-if-absent is atomic (required to commit).
        fsync: Files and folders must be fsynced by us to be durable (local disk).
        permissions: POSIX modes apply (owner-only files are meaningful).
    """

    exclusive_create: bool
    fsync: bool
    permissions: bool


def url_filesystem(
    url: str, storage_options: dict[str, Any], fs: fsspec.AbstractFileSystem | None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem `url` lies on and the path inside it (`fs` given: `url` is the
    path inside `fs`)."""
    if fs is None:
        fs, root = fsspec.core.url_to_fs(url, **storage_options)
        return fs, str(root)
    return fs, str(fs._strip_protocol(url))


def fs_protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    """The protocols `fs` serves, as a tuple whatever fsspec's form."""
    return tuple(fs.protocol) if isinstance(fs.protocol, tuple) else (str(fs.protocol),)


class Backend(abc.ABC):
    """A store root behind an fsspec URL.

    `state.open_backend(url, ...)` builds the subclass for the URL's filesystem;
    subclasses are built directly too.

    Args:
        url: a local path, `file://`, `memory://`, `s3://`, or any fsspec URL.
        storage_options: passed to fsspec (and to zarr for its own async filesystem).
        fs: an already built filesystem to use instead of resolving `url`'s protocol
            (the fault injector's wrapper); `url` then names the path inside it.
        retry: policy for transient errors of idempotent operations.
    """

    #: Local disk: zarr chunks are written with os calls, paths resolve through links.
    local: bool = False
    capabilities: Capabilities

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        #: Retries the idempotent operations below. `create_exclusive` is not retried
        #: here: only its caller can tell its own landed create from someone else's.
        self.retry = retry or RetryPolicy()
        fs, root = url_filesystem(url, self.storage_options, fs)
        self.fs: fsspec.AbstractFileSystem = fs
        self.protocols = fs_protocols(fs)
        self.protocol: str = self.protocols[0]
        self.root: str = root.rstrip("/") if root != "/" else root
        self.url = url
        self.capabilities = self._capabilities()

    @abc.abstractmethod
    def _capabilities(self) -> Capabilities:
        """This backend's flags (called once, at construction)."""

    # paths -----------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Absolute path inside the filesystem of `rel` (relative to the root)."""
        return f"{self.root}/{rel}" if rel else self.root

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def root_is_file(self) -> bool:
        """Whether the root is a plain file (no store can be made there)."""
        return False

    def escaping_link(self, rel: str) -> str | None:
        """The first of `rel` and the links under it that resolves outside the root, or
        None. Only local disk has links; elsewhere a path's form is all there is."""
        return None

    # reads -----------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        return bool(self.retry.call(lambda: self.fs.exists(self.path(rel))))

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.retry.call(lambda: self.fs.cat_file(self.path(rel))))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; empty when it does not exist."""
        try:
            entries = self.retry.call(lambda: self.fs.ls(self.path(rel), detail=False))
        except FileNotFoundError:
            return []
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def find(self, rel: str) -> list[str]:
        """Every file under `rel`, as paths relative to the root."""
        base = self.path(rel)
        try:
            found = self.retry.call(lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        return sorted(str(p)[len(prefix) :] for p in found if str(p).startswith(prefix))

    def sizes(self, rel: str) -> dict[str, int]:
        """Every file under `rel` with its size in bytes, by path relative to the root
        (one recursive listing: a paged LIST on object stores)."""
        base = self.path(rel)
        try:
            found = self.retry.call(lambda: self.fs.find(base, detail=True))
        except FileNotFoundError:
            return {}
        prefix = self.root.rstrip("/") + "/"
        return {
            str(p)[len(prefix) :]: int(info.get("size") or 0)
            for p, info in found.items()
            if str(p).startswith(prefix)
        }

    def modified(self, rel: str) -> float | None:
        """When file `rel` was last written, seconds since the epoch (the storage's
        clock), or None when the storage does not say or the file is gone."""
        try:
            info = self.retry.call(lambda: self.fs.info(self.path(rel)))
        except FileNotFoundError:
            return None
        stamp = info.get("mtime", info.get("LastModified", info.get("last_modified")))
        if isinstance(stamp, (int, float)):
            return float(stamp)
        return stamp.timestamp() if hasattr(stamp, "timestamp") else None

    # reads that another process's writes must not miss -----------------------------
    def invalidate(self, rel: str | None = None) -> None:
        """Forget what the filesystem cached about `rel` and its parents (None: about
        everything). s3fs answers `ls`, `exists` and even the size probe of `cat_file`
        from listings it cached earlier, so without this another process's new lease
        generation or manifest stays invisible to this one. Local disk and memory://
        cache nothing; for them this does nothing."""
        if rel is None:
            self.fs.invalidate_cache()
        else:
            self.fs.invalidate_cache(self.path(rel))

    def exists_fresh(self, rel: str) -> bool:
        """`exists`, asked of the storage itself (one HEAD on S3), not of a cache."""
        self.invalidate(rel)
        return self.exists(rel)

    def listdir_fresh(self, rel: str) -> list[str]:
        """`listdir`, listed by the storage itself, not taken from a cache."""
        self.invalidate(rel)
        return self.listdir(rel)

    # writes ----------------------------------------------------------------------
    @abc.abstractmethod
    def replace(self, rel: str, data: bytes) -> None:
        """Write small owner-only bytes at `rel`, replacing what is there, atomically: a
        reader sees the old or the new bytes, never a mix. For objects rewritten in
        place, such as a lease's heartbeat; never for anything a manifest references
        (those are write-once)."""

    @abc.abstractmethod
    def makedirs(self, rel: str, *, private: bool = True) -> None:
        """Create folder `rel` and its missing parents (owner-only where modes apply;
        `private` is kept for callers and changes nothing: there is no shared mode)."""

    @abc.abstractmethod
    def write_staged(
        self, rel: str, parts: Sequence[bytes | memoryview], *, exclusive: bool
    ) -> None:
        """Write a file of a version in progress: `parts`' bytes one after another.

        Durable only once `fsync_tree` of a folder above it returns (the commit calls
        it before the manifest); until then a crash may lose it, which is harmless
        because no manifest references it yet. Folders are created as needed.

        Args:
            exclusive: fail with FileExistsError if `rel` exists (a chunk); otherwise
                replace it (group metadata, identical whoever writes it).
        """

    @abc.abstractmethod
    def write_once(self, rel: str, data: bytes, *, private: bool = False) -> None:
        """Write a file at a path that is never overwritten once it is referenced; a
        crash leaves either nothing or the whole file (plus at most a `.partial`
        leftover). Every file of a store is owner-only, whatever `private` says."""

    def create_exclusive(
        self, rel: str, data: bytes, on_temp_durable: Callable[[], None] | None = None
    ) -> None:
        """Create `rel` with `data` only if it does not exist: the commit primitive.

        Args:
            on_temp_durable: called once the bytes are durable but not yet visible
                (local disk: the temp file; a crash point).

        Raises:
            FileExistsError: `rel` already exists (someone else's, or ours from a try
                whose response was lost: the caller reads it back to tell).
            StoreError: the backend has no atomic exclusive create.
        """
        if not self.capabilities.exclusive_create:
            raise StoreError(
                f"{self.url}: protocol {self.protocol!r} offers no atomic create-if-absent, "
                "so a commit cannot be made safe; use a local path, memory:// or s3://"
            )
        self._create_exclusive(rel, data, on_temp_durable)

    @abc.abstractmethod
    def _create_exclusive(
        self, rel: str, data: bytes, on_temp_durable: Callable[[], None] | None
    ) -> None:
        """`create_exclusive` once its capability is checked."""

    def create_once(
        self, rel: str, data: bytes, on_temp_durable: Callable[[], None] | None = None
    ) -> None:
        """`create_exclusive`, retried on transient errors. A create whose response was
        lost is recognised on the retry by reading the object back: identical bytes are
        our own (every caller's bytes are unique: a write id, an owner, a random key).

        Raises:
            FileExistsError: `rel` exists with other bytes (someone else created it).
        """

        def attempt() -> None:
            try:
                self.create_exclusive(rel, data, on_temp_durable)
            except FileExistsError:
                # Read what won, not a cached listing from before it existed (s3fs
                # would answer FileNotFoundError from one).
                self.invalidate(rel)
                if self.read_bytes(rel) != data:
                    raise

        self.retry.call(attempt)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        try:
            self.retry.call(lambda: self.fs.rm(self.path(rel), recursive=recursive))
        except FileNotFoundError:
            pass

    @abc.abstractmethod
    def fsync_tree(self, rel: str) -> None:
        """Make every file and folder under `rel` durable where the storage needs us to
        (`capabilities.fsync`); object stores are durable once a PUT returns."""

    @abc.abstractmethod
    def chmod_private(self, rel: str) -> None:
        """Owner-only permissions on a file or folder where modes apply."""

    @abc.abstractmethod
    def zarr_store(self, rel: str) -> ZarrStore:
        """A zarr store rooted at `rel`, for zarr's own reads and writes."""
