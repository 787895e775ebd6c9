"""Local disk: temp file + fsync + link for the commit, owner-only modes, fsynced folders.

zarr never fsyncs, and a rename silently overwrites on POSIX, so this backend writes
every file that is visible once written through a temp file it fsyncs, commits with
`os.link` (which fails if the target exists) and fsyncs folders so that new entries
survive a power loss. A version's own files are invisible until its manifest exists, so
they are written in place and fsynced in the background; the commit waits for them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import stat
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import zarr.storage
from zarr.abc.store import Store as ZarrStore

from .backend import Backend, Capabilities
from .errors import UnsafeFileError
from .file_writes import write_all, write_parts
from .paths import partial_path
from .retry import RetryPolicy
from .threads import run_all, submit_or_run

__all__ = ["LocalBackend"]

_FSYNC_THREADS = 8
_STAGED_THREADS = 4
_STAGED_OPEN = 64  # staged files whose fsync is still to come, at most


class LocalBackend(Backend):
    """A store root on local disk (a path or a `file://` URL)."""

    local = True

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        fs: fsspec.AbstractFileSystem | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        super().__init__(url, storage_options, fs, retry)
        self._staged = _StagedSyncs()
        # Folders `write_staged` made or found: a version's files are written from its
        # writer thread while the training thread holds the GIL most of the time, and
        # each syscall then costs a wait for the GIL (up to the 5 ms switch interval).
        # A stat per file to find its folder there was half of the writes' wall time on
        # the digits job. A folder deleted since is made again when the open fails.
        self._folders: set[str] = set()

    def _capabilities(self) -> Capabilities:
        return Capabilities(exclusive_create=True, fsync=True, permissions=True)

    def root_is_file(self) -> bool:
        return os.path.exists(self.root) and not os.path.isdir(self.root)

    def escaping_link(self, rel: str) -> str | None:
        """The first of `rel` and the links under it that resolves outside the root (both
        real paths are compared), or None. Links to folders inside the store are
        followed."""
        root = os.path.realpath(self.root)
        seen: set[str] = set()
        pending = [self.path(rel)]
        while pending:
            path = pending.pop()
            real = os.path.realpath(path)
            if real != root and not real.startswith(root + os.sep):
                return path
            if real in seen or not os.path.isdir(real):
                continue
            seen.add(real)
            with os.scandir(real) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        pending.append(entry.path)
                    elif entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
        return None

    def read_bytes(self, rel: str) -> bytes:
        """The bytes of file `rel`, refused without blocking or reading when it is not a
        regular file (a FIFO would block the open and the read for ever; a device, a
        folder) or resolves outside the root (a link out of the store: manifests, leases
        and secrets are confined as arrays are).

        Raises:
            FileNotFoundError: there is no such file.
            UnsafeFileError: naming the file and what it is.
        """
        path = self.path(rel)
        real = os.path.realpath(path)
        root = os.path.realpath(self.root)
        if not real.startswith(root + os.sep):
            if not os.path.lexists(path):
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            raise UnsafeFileError(
                f"{self.url}: {rel} resolves to {real}, outside the store; a store's files "
                "are read only inside it, so it is refused: replace the link by the file",
                path=rel,
            )
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)  # the file opened, not whatever the name points to now
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeFileError(
                    f"{self.url}: {rel} is {_kind(st.st_mode)}, not a regular file, so it "
                    "is refused unread: move it away (the store writes only regular files)",
                    path=rel,
                )
            chunks = []
            while chunk := os.read(fd, max(st.st_size, 1 << 16)):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def replace(self, rel: str, data: bytes) -> None:
        """Temp file + fsync + rename: a reader sees the old or the new bytes."""
        final = self.path(rel)
        tmp = partial_path(final, uuid.uuid4().hex)
        _write_durable(tmp, data)
        try:
            os.replace(tmp, final)
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    # Listings with os.scandir, not fsspec: LocalFileSystem.find stats every entry twice
    # through info() and strips every path again, 45 ms of retention's CPU per commit
    # on the mlp example's store where scandir takes ~1 ms. The results are fsspec's:
    # a link is listed as a file (a link to a folder is not descended), sized as what
    # it points at, a broken one as 0 bytes. tests/state/test_local_listing.py holds
    # them against fsspec's.
    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; empty when it does not exist."""
        path = self.path(rel)
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return [os.path.basename(path)]

    def find(self, rel: str) -> list[str]:
        """Every file under `rel`, as paths relative to the root."""
        return sorted(self._files(rel, sized=False))

    def sizes(self, rel: str) -> dict[str, int]:
        """Every file under `rel` with its size in bytes, by path relative to the root."""
        return dict(sorted(self._files(rel, sized=True).items()))

    def _files(self, rel: str, *, sized: bool) -> dict[str, int]:
        base = self.path(rel)
        prefix = self.root.rstrip("/") + "/"
        out: dict[str, int] = {}
        if not os.path.isdir(base):
            if os.path.exists(base) and base.startswith(prefix):
                out[base[len(prefix) :]] = _size(base) if sized else 0
            return out
        pending = [base]
        while pending:
            folder = pending.pop()
            try:
                entries = list(os.scandir(folder))
            except (FileNotFoundError, NotADirectoryError):
                continue  # deleted while listed: what is gone is not listed
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                elif entry.path.startswith(prefix):
                    out[entry.path[len(prefix) :]] = _size(entry.path) if sized else 0
        return out

    def makedirs(self, rel: str, *, private: bool = True) -> None:
        """Every folder this creates is 0700 whatever the umask."""
        _makedirs_private(self.path(rel))

    def write_staged(
        self, rel: str, parts: Sequence[bytes | memoryview], *, exclusive: bool
    ) -> None:
        """Write with os calls, 0600 in 0700 folders whatever the umask (chunks hold the
        noise history and the model), and start the file's fsync in the background:
        `fsync_tree` waits for it."""
        path = self.path(rel)
        folder = os.path.dirname(path)
        if folder not in self._folders:
            self._make_folder(folder)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:  # the folder went since it was made (a retention)
            self._folders.clear()
            self._make_folder(folder)
            fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # open's mode is masked by the umask; fchmod's is not
            write_parts(fd, parts)
        except BaseException:
            os.close(fd)
            raise
        self._staged.submit(path, fd)

    def _make_folder(self, folder: str) -> None:
        """`_makedirs_private`, remembered (a long job's old folders are forgotten)."""
        _makedirs_private(folder)
        if len(self._folders) > 4096:
            self._folders.clear()
        self._folders.add(folder)

    def write_once(self, rel: str, data: bytes, *, private: bool = False) -> None:
        """Temp file, fsync, rename into place, fsync the folder; the file is 0600."""
        final = self.path(rel)
        parent = os.path.dirname(final)
        _makedirs_private(parent)
        tmp = partial_path(final, uuid.uuid4().hex)
        _write_durable(tmp, data)
        os.replace(tmp, final)
        _fsync_path(parent)

    def _create_exclusive(
        self, rel: str, data: bytes, on_temp_durable: Callable[[], None] | None
    ) -> None:
        final = self.path(rel)
        parent = os.path.dirname(final)
        _makedirs_private(parent)
        tmp = partial_path(final, uuid.uuid4().hex)
        _write_durable(tmp, data)
        try:
            if on_temp_durable is not None:
                on_temp_durable()
            os.link(tmp, final)  # atomic, and fails if `final` exists: never overwrites
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_path(parent)

    def fsync_tree(self, rel: str) -> None:
        """fsync every file and folder under `rel` and `rel`'s parents up to the root.

        zarr never fsyncs; without this a power loss can lose acknowledged chunks. The
        fsyncs of staged files were started as they were written; this waits for them
        (and raises the first one's error), then fsyncs the other files, then the
        folders. Those fsyncs are issued from several threads at once: the filesystem
        journal then commits them together instead of once per file. A file already
        fsynced is not fsynced again: on ext4 that would still flush the disk cache.
        """
        top = self.path(rel)
        synced = self._staged.wait_under(top)
        files: list[str] = []
        folders: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(top):
            for name in filenames:
                path = os.path.join(dirpath, name)
                if path not in synced:
                    files.append(path)
            folders.append(dirpath)
        run_all(_fsync_path, _FSYNC_THREADS, files, folders)
        parent = os.path.dirname(top)
        while len(parent) >= len(self.root):
            _fsync_path(parent)
            if parent == self.root:
                break
            parent = os.path.dirname(parent)

    def chmod_private(self, rel: str) -> None:
        """0600 for a file, 0700 for a folder."""
        path = self.path(rel)
        os.chmod(path, 0o700 if os.path.isdir(path) else 0o600)

    def zarr_store(self, rel: str) -> ZarrStore:
        return zarr.storage.LocalStore(self.path(rel))


class _StagedSyncs:
    """The fsyncs of staged files, each started in a background thread as soon as its
    file is written, so the disk writes one file while the writer copies the next into
    the page cache. np.save + fsync, and fsyncing every file at the commit, leave the
    disk idle during every copy: bench/checkpoint.py measured writes at 0.81 of np.save
    + fsync that way (docs/benchmarks.md)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, concurrent.futures.Future[None]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._open = threading.BoundedSemaphore(_STAGED_OPEN)
        self._pid = 0

    def submit(self, path: str, fd: int) -> None:
        """fsync and close `fd`, open on `path`, in the background (this takes `fd`).

        Blocks while `_STAGED_OPEN` files wait for theirs: a version of many small
        arrays must not run out of file descriptors."""
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # a forked child has none of its parent's threads, nor their work
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _STAGED_THREADS, thread_name_prefix="state-fsync"
                )
                self._open = threading.BoundedSemaphore(_STAGED_OPEN)
                self._pid = os.getpid()
                self._pending = {}
            pool, slots = self._pool, self._open
        slots.acquire()
        future = submit_or_run(pool, _fsync_close, fd, slots)  # inline while exiting
        with self._lock:
            self._pending[path] = future

    def wait_under(self, top: str) -> set[str]:
        """Wait for every background fsync of a file under `top`; the files synced.

        Raises:
            OSError: the first failed fsync's error. Its entry stays, so asking again
                raises again: after a failed fsync Linux may drop the dirty pages and
                report the next fsync of the file clean.
        """
        prefix = top.rstrip(os.sep) + os.sep
        with self._lock:
            mine = [(p, f) for p, f in self._pending.items() if p.startswith(prefix)]
        concurrent.futures.wait([f for _, f in mine])
        synced = {p for p, f in mine if f.exception() is None}
        with self._lock:
            for path, future in mine:
                if path in synced and self._pending.get(path) is future:
                    del self._pending[path]
        for _, future in mine:
            future.result()  # raises the first failure
        return synced


def _fsync_close(fd: int, slots: threading.BoundedSemaphore) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
        slots.release()


def _write_durable(path: str, data: bytes) -> None:
    """Create `path` (0600 whatever the umask: the noise history and the model are as
    secret as the key), write `data` and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # open's mode is masked by the umask; fchmod's is not
        write_all(fd, [data])
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_private(path: str) -> None:
    """`os.makedirs(path, exist_ok=True)`, but every folder it creates is 0700: makedirs
    gives the parents it creates the umask's mode, and a mkdir mode is masked by it.
    mkdir first, parents only when it says they are missing: a new folder under an
    existing one costs two syscalls (mkdir, chmod), an existing one a failed mkdir and
    a stat."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return  # there already, or made at the same moment by another writer
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if parent == os.path.abspath(path):
            raise
        _makedirs_private(parent)
        _makedirs_private(path)
        return
    os.chmod(path, 0o700)


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((words for test, words in kinds if test(mode)), "not a file")


def _size(path: str) -> int:
    """A file's size; a link's target's (0 when broken), as fsspec's local info."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _fsync_path(path: str) -> None:
    """fsync a file or a folder (a folder's fsync makes its new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
