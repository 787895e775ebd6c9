"""`state`: an atomic, versioned array-state store over zarr v3 and fsspec.

Knows arrays, JSON records, versions, checksums, leases and retention; knows nothing
about privacy or torch.
"""

from . import hooks, paths
from .backend import Backend, Capabilities
from .checksum import array_checksum
from .errors import (
    CommitConflictError,
    CorruptVersionError,
    FencedError,
    ForgedVersionError,
    FormatVersionError,
    LeaseHeldError,
    NotAStoreError,
    StoreError,
    StoreNotFoundError,
    UnauthenticatedVersionError,
    UnsafePathError,
    VersionNotFoundError,
)
from .fsspec_backend import FsspecBackend
from .lease import Lease
from .local_backend import LocalBackend
from .manifest import FORMAT_VERSION, MAC_KEY_BYTES, ArrayMeta, Manifest, ManifestMacs, restamp
from .open import open_backend
from .reachability import Space
from .retention import KeepEvery, KeepLast, KeepVersions, OnDamage, RetentionPolicy
from .retry import RetryPolicy, is_transient
from .store import Store
from .transaction import ShardWriter, Transaction
from .version import Version

__all__ = [
    "FORMAT_VERSION",
    "MAC_KEY_BYTES",
    "ArrayMeta",
    "Backend",
    "Capabilities",
    "CommitConflictError",
    "CorruptVersionError",
    "FencedError",
    "ForgedVersionError",
    "FormatVersionError",
    "FsspecBackend",
    "KeepEvery",
    "KeepLast",
    "KeepVersions",
    "Lease",
    "LeaseHeldError",
    "LocalBackend",
    "Manifest",
    "ManifestMacs",
    "NotAStoreError",
    "OnDamage",
    "RetentionPolicy",
    "RetryPolicy",
    "ShardWriter",
    "Space",
    "Store",
    "StoreError",
    "StoreNotFoundError",
    "Transaction",
    "UnauthenticatedVersionError",
    "UnsafePathError",
    "Version",
    "VersionNotFoundError",
    "array_checksum",
    "hooks",
    "is_transient",
    "open_backend",
    "paths",
    "restamp",
]
