"""`state`: an atomic, versioned array-state store over zarr v3 and fsspec.

Knows arrays, JSON records, versions, checksums, leases and retention; knows nothing
about privacy or torch.
"""

from . import hooks
from .backend import Backend, Capabilities
from .checksum import array_checksum
from .errors import (
    CommitConflictError,
    CorruptVersionError,
    FencedError,
    FormatVersionError,
    LeaseHeldError,
    NotAStoreError,
    StoreError,
    StoreNotFoundError,
    UnsafePathError,
    VersionNotFoundError,
)
from .lease import Lease
from .manifest import FORMAT_VERSION, ArrayMeta, Manifest, restamp
from .retry import RetryPolicy, is_transient
from .store import ShardWriter, Store, Transaction, Version

__all__ = [
    "FORMAT_VERSION",
    "ArrayMeta",
    "Backend",
    "Capabilities",
    "CommitConflictError",
    "CorruptVersionError",
    "FencedError",
    "FormatVersionError",
    "Lease",
    "LeaseHeldError",
    "Manifest",
    "NotAStoreError",
    "RetryPolicy",
    "ShardWriter",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "Transaction",
    "UnsafePathError",
    "Version",
    "VersionNotFoundError",
    "array_checksum",
    "hooks",
    "is_transient",
    "restamp",
]
