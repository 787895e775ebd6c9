"""Errors raised by the `state` store. Each mixes in the builtin callers already catch."""

from __future__ import annotations

__all__ = [
    "CommitConflictError",
    "CorruptVersionError",
    "FencedError",
    "FormatVersionError",
    "LeaseHeldError",
    "StoreError",
    "StoreNotFoundError",
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


class FormatVersionError(StoreError, ValueError):
    """The store was written by a newer, incompatible format."""


class CorruptVersionError(StoreError, ValueError):
    """A version failed verification: unparsable manifest, missing array, bad checksum.

    Attributes:
        version: the damaged version number.
        path: the array or manifest path that failed, relative to the store root.
    """

    def __init__(self, message: str, *, version: int, path: str) -> None:
        super().__init__(message)
        self.version = version
        self.path = path


class LeaseHeldError(StoreError, PermissionError):
    """Another live writer holds the store's lease."""


class FencedError(StoreError, PermissionError):
    """This writer's lease was taken over; it may no longer commit."""


class CommitConflictError(StoreError, FileExistsError):
    """Another writer committed the same version number first."""
