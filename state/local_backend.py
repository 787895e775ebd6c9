"""Local disk: temp file + fsync + link for the commit, owner-only modes, fsynced folders.

zarr never fsyncs, and a rename silently overwrites on POSIX, so this backend writes
every file through a temp file it fsyncs, commits with `os.link` (which fails if the
target exists) and fsyncs folders so that new entries survive a power loss.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import uuid
from collections.abc import Callable

import zarr.storage
from zarr.abc.store import Store as ZarrStore

from .backend import Backend, Capabilities
from .paths import partial_path

__all__ = ["LocalBackend"]

_FSYNC_THREADS = 8


class LocalBackend(Backend):
    """A store root on local disk (a path or a `file://` URL)."""

    local = True

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

    def makedirs(self, rel: str, *, private: bool = True) -> None:
        """Every folder this creates is 0700 whatever the umask."""
        _makedirs_private(self.path(rel))

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
        fsyncs are issued from several threads at once: the filesystem journal then
        commits them together instead of once per file. Files go before their folders.
        """
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
        """0600 for a file, 0700 for a folder."""
        path = self.path(rel)
        os.chmod(path, 0o700 if os.path.isdir(path) else 0o600)

    def zarr_store(self, rel: str) -> ZarrStore:
        return zarr.storage.LocalStore(self.path(rel))


def _write_durable(path: str, data: bytes) -> None:
    """Create `path` (0600 whatever the umask: the noise history and the model are as
    secret as the key), write `data` and fsync it."""
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
