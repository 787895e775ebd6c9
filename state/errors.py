"""Errors raised by the `state` store. Each mixes in the builtin callers already catch."""

from __future__ import annotations

__all__ = [
    "CommitConflictError",
    "CorruptVersionError",
    "FencedError",
    "ForgedVersionError",
    "FormatVersionError",
    "LeaseHeldError",
    "NotAStoreError",
    "StoreError",
    "StoreNotFoundError",
    "UnauthenticatedVersionError",
    "UnsafeFileError",
    "UnsafePathError",
    "VersionNotFoundError",
]


class StoreError(Exception):
    """Base of every error the store raises."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The URL holds no cocoon-ckpt store."""


class VersionNotFoundError(StoreError, KeyError):
    """A version that was asked for does not exist."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain.
        return str(self.args[0]) if self.args else ""


class NotAStoreError(StoreNotFoundError):
    """The location holds something else (a file, a user folder, a zarr v2 store, a plain
    zarr v3 group): it is neither opened nor turned into a store."""


class FormatVersionError(StoreError, ValueError):
    """The store or a manifest is of a format this library does not read: a newer one,
    or an older one without record checksums."""


class CorruptVersionError(StoreError, ValueError):
    """A version failed verification: unparsable manifest, a record or header that fails
    its checksum, missing array, bad checksum.

    Attributes:
        version: the damaged version number.
        path: the array or manifest path that failed, relative to the store root.
        record: for a damaged manifest, the record that failed (its name in `records`),
            or `"header"` for the fields around the records; None for an array.
    """

    def __init__(self, message: str, *, version: int, path: str, record: str | None = None) -> None:
        super().__init__(message)
        self.version = version
        self.path = path
        self.record = record


class ForgedVersionError(CorruptVersionError):
    """A version's MAC fails under the MAC key the store was opened with: it was written
    or edited by someone without the key (or damaged after its checksums were
    recomputed). `record` names the record that fails, or `"header"`."""


class UnauthenticatedVersionError(CorruptVersionError):
    """A version carries no MAC although the store was opened with a MAC key that
    requires one: written before store format 4, without a key, or its MACs stripped."""


class UnsafePathError(CorruptVersionError):
    """A manifest names an array path that is not confined to the store: `..`, absolute,
    an empty or odd component, outside versions/ and shared/, or (local disk) a link
    that resolves outside the store root.

    Attributes:
        array: the logical array name whose path was refused.
    """

    def __init__(self, message: str, *, version: int, path: str, array: str) -> None:
        super().__init__(message, version=version, path=path)
        self.array = array


class UnsafeFileError(StoreError):
    """A file of the store that a reader refuses to read: not a regular file (a FIFO, a
    device, a folder), or (local disk) a link that resolves outside the store root.

    Attributes:
        path: the file, relative to the store root.
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class LeaseHeldError(StoreError, PermissionError):
    """Another live writer holds the store's lease."""


class FencedError(StoreError, PermissionError):
    """This writer's lease was taken over; it may no longer commit."""


class CommitConflictError(StoreError, FileExistsError):
    """Another writer committed the same version number first."""
