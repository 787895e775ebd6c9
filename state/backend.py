"""One storage location behind an fsspec URL, with the capabilities the commit needs.

The commit point of a version is the exclusive creation of its manifest, so a backend
must offer create-if-absent: local disk does it with temp file + fsync + `os.link`
(link fails if the target exists; rename would silently overwrite), object stores with
one conditional PUT (`pipe_file(..., mode="create")`, If-None-Match on S3). fsspec's
rename on object stores is copy + delete and is never used for a commit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import zarr.storage
from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper
from zarr.abc.store import Store as ZarrStore

from .errors import StoreError
from .retry import RetryPolicy

__all__ = ["Backend", "Capabilities"]

# Protocols whose create-if-absent is known to be atomic and exclusive.
_FSYNC_THREADS = 8
_EXCLUSIVE_PROTOCOLS = {"file", "local", "memory", "s3", "s3a"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Capabilities:
    """What a backend can do; the commit protocol is chosen from these flags."""

    exclusive_create: bool
    """Create-if-absent is atomic (required to commit)."""
    fsync: bool
    """Files and folders must be fsynced by us to be durable (local disk)."""
    permissions: bool
    """POSIX modes apply (owner-only files are meaningful)."""


class Backend:
    """A store root behind an fsspec URL.

    Args:
        url: a local path, `file://`, `memory://`, `s3://`, or any fsspec URL.
        storage_options: passed to fsspec (and to zarr for its own async filesystem).
        fs: an already built filesystem to use instead of resolving `url`'s protocol
            (the fault injector's wrapper); `url` then names the path inside it.
        retry: policy for transient errors of idempotent operations.
    """

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
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        else:
            root = fs._strip_protocol(url)
        self.fs: fsspec.AbstractFileSystem = fs
        protos = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
        self.protocol: str = protos[0]
        self.local = self.protocol in ("file", "local")
        self.root: str = root.rstrip("/") if root != "/" else root
        self.url = url
        exclusive = bool(set(protos) & _EXCLUSIVE_PROTOCOLS) or bool(
            getattr(fs, "cocoon_exclusive_create", False)
        )
        self.capabilities = Capabilities(
            exclusive_create=exclusive, fsync=self.local, permissions=self.local
        )

    # paths -----------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Absolute path inside the filesystem of `rel` (relative to the root)."""
        return f"{self.root}/{rel}" if rel else self.root

    def __repr__(self) -> str:
        return f"Backend({self.url!r})"

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

    def replace(self, rel: str, data: bytes) -> None:
        """Write small owner-only bytes at `rel`, replacing what is there, atomically: a
        reader sees the old or the new bytes, never a mix (local disk: temp file + rename;
        object stores: one PUT). For objects rewritten in place, such as a lease's
        heartbeat; never for anything a manifest references (those are write-once)."""
        if not self.local:
            self.retry.call(lambda: self.fs.pipe_file(self.path(rel), data))
            return
        final = self.path(rel)
        tmp = f"{final}.{uuid.uuid4().hex}.partial"
        self._write_local_durable(tmp, data, private=True)
        try:
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # writes ----------------------------------------------------------------------
    def makedirs(self, rel: str, *, private: bool = True) -> None:
        """Create folder `rel` and its missing parents. On local disk every folder this
        creates is owner-only (0700) whatever the umask; `private` is kept for callers
        and changes nothing (there is no shared mode)."""
        path = self.path(rel)
        if self.local:
            _makedirs_private(path)
        else:
            self.retry.call(lambda: self.fs.makedirs(path, exist_ok=True))

    def write_once(self, rel: str, data: bytes, *, private: bool = False) -> None:
        """Write a file at a path that is never overwritten once it is referenced.

        Local disk: temp file, fsync, rename into place, fsync the folder, so a crash
        leaves either nothing or the whole file (plus at most a `.partial` leftover).
        The file is 0600 whatever `private` says (every file of a store is owner-only).
        """
        if not self.local:
            self.retry.call(lambda: self.fs.pipe_file(self.path(rel), data))
            return
        final = self.path(rel)
        parent = os.path.dirname(final)
        _makedirs_private(parent)
        tmp = f"{final}.{uuid.uuid4().hex}.partial"
        self._write_local_durable(tmp, data)
        os.replace(tmp, final)
        _fsync_path(parent)

    def create_exclusive(self, rel: str, data: bytes, on_temp_durable: Any = None) -> None:
        """Create `rel` with `data` only if it does not exist: the commit primitive.

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
        if not self.local:
            self.fs.pipe_file(self.path(rel), data, mode="create")
            return
        final = self.path(rel)
        parent = os.path.dirname(final)
        _makedirs_private(parent)
        tmp = f"{final}.{uuid.uuid4().hex}.partial"
        self._write_local_durable(tmp, data)
        try:
            if on_temp_durable is not None:
                on_temp_durable()
            os.link(tmp, final)  # atomic, and fails if `final` exists: never overwrites
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_path(parent)

    def create_once(self, rel: str, data: bytes, on_temp_durable: Any = None) -> None:
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
                if self.read_bytes(rel) != data:
                    raise

        self.retry.call(attempt)

    def rm(self, rel: str, *, recursive: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.retry.call(lambda: self.fs.rm(self.path(rel), recursive=recursive))

    def fsync_tree(self, rel: str) -> None:
        """fsync every file and folder under `rel` and `rel`'s parents up to the root.

        zarr never fsyncs; without this a power loss can lose acknowledged chunks. The
        fsyncs are issued from several threads at once: the filesystem journal then
        commits them together instead of once per file. Files go before their folders.
        """
        if not self.capabilities.fsync:
            return
        top = self.path(rel)
        files: list[str] = []
        folders: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(top):
            files.extend(os.path.join(dirpath, name) for name in filenames)
            folders.append(dirpath)
        with concurrent.futures.ThreadPoolExecutor(max_workers=_FSYNC_THREADS) as pool:
            list(pool.map(_fsync_path, files))
            list(pool.map(_fsync_path, folders))
        parent = os.path.dirname(top)
        while len(parent) >= len(self.root):
            _fsync_path(parent)
            if parent == self.root:
                break
            parent = os.path.dirname(parent)

    def chmod_private(self, rel: str) -> None:
        """Owner-only permissions on a local file or folder (0600 / 0700)."""
        if not self.capabilities.permissions:
            return
        path = self.path(rel)
        os.chmod(path, 0o700 if os.path.isdir(path) else 0o600)

    def zarr_store(self, rel: str) -> ZarrStore:
        """A zarr store rooted at `rel`, for zarr's own reads and writes."""
        if self.local:
            return zarr.storage.LocalStore(self.path(rel))
        if self.protocol in ("s3", "s3a"):
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

    @staticmethod
    def _write_local_durable(path: str, data: bytes, *, private: bool = True) -> None:
        """Create `path` (0600 whatever the umask and `private`: the noise history and
        the model are as secret as the key), write `data` and fsync it."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # open's mode is masked by the umask; fchmod's is not
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)


def _makedirs_private(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)`, but every folder it creates is 0700: makedirs
    gives the parents it creates the umask's mode, and a mkdir mode is masked by it."""
    if os.path.isdir(path):
        return
    missing = []
    here = os.path.abspath(path)
    while not os.path.exists(here):
        missing.append(here)
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue  # made at the same moment by another writer of this store
        os.chmod(folder, 0o700)


def _fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
