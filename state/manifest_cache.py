"""Manifests a store has verified, each remembered with a digest of its bytes.

Retention verifies every manifest it keeps before it deletes anything, after every
commit. Verifying one (checksums of every record, then the whole canonical form again)
costs ~5 ms at 40 KB, where reading it and hashing its bytes costs ~0.1 ms; so a
manifest is parsed and verified once, and afterwards trusted only while the bytes read
from the store hash to what it was verified from. A manifest altered after it was
cached (torn, edited, restamped, another version written at its number) hashes
differently and is verified again, so it fails as it would have without the cache.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING

from .errors import CorruptVersionError, UnsafeFileError, VersionNotFoundError
from .manifest import Manifest
from .paths import manifest_path

if TYPE_CHECKING:
    from .store import Store

__all__ = ["ManifestCache", "refused_manifest"]


def refused_manifest(exc: UnsafeFileError, version: int) -> CorruptVersionError:
    """A manifest the backend refused to read (a FIFO, a link out of the store) as the
    damage of its version: fallback, retention and audit then pass over it as over any
    damaged version."""
    return CorruptVersionError(
        f"version {version} of {exc}", version=version, path=exc.path, record="header"
    )


def _digest(data: bytes) -> bytes:
    # sha256, not size + mtime: a rewrite within the clock's granularity, or one that
    # restores the mtime, keeps both, and the bytes are in hand anyway.
    return hashlib.sha256(data).digest()


class ManifestCache:
    """Verified manifests of one store, by version, each with the sha256 of the bytes
    it was parsed from. Thread-safe (the checkpoint writer's retention and a caller's
    `retain` may share a store).

    The manifests handed out are shared between callers: treat them as read-only.
    """

    def __init__(self) -> None:
        self._verified: dict[int, tuple[bytes, Manifest]] = {}
        self._lock = threading.Lock()

    def manifest(self, store: Store, version: int) -> Manifest:
        """Version `version`'s manifest, read now and verified unless these very bytes
        were verified before.

        Raises:
            VersionNotFoundError: no such version.
            CorruptVersionError: the manifest is torn, malformed or fails a checksum.
            FormatVersionError: it is of a format this library does not read.
        """
        try:
            data = store.backend.read_bytes(manifest_path(version))
        except FileNotFoundError:
            self.forget(version)
            raise VersionNotFoundError(
                f"{store.url} has no version {version} (its manifest {manifest_path(version)} "
                "is gone); list the store's versions again"
            ) from None
        except UnsafeFileError as exc:
            raise refused_manifest(exc, version) from exc
        digest = _digest(data)
        with self._lock:
            hit = self._verified.get(version)
        if hit is not None and hit[0] == digest:
            return hit[1]
        self.forget(version)  # the bytes changed: never trust the old parse again
        parsed = Manifest.from_bytes(data, version=version, where=store.url)
        with self._lock:
            self._verified[version] = (digest, parsed)
        return parsed

    def remember(self, version: int, data: bytes, where: str) -> None:
        """Take version `version`'s manifest as verified from `data`, the bytes this
        process has just committed (`Manifest.to_bytes` made them canonical and
        checksummed). They are trusted only while the store's bytes hash the same, as a
        verified read is: retention after every commit then parses the new manifest
        once, cheaply, instead of verifying what it wrote itself."""
        parsed = Manifest.from_own_bytes(data, where=where)
        with self._lock:
            self._verified[version] = (_digest(data), parsed)

    def forget(self, version: int) -> None:
        """Drop version `version` (deleted, or its bytes changed)."""
        with self._lock:
            self._verified.pop(version, None)

    def keep_only(self, versions: Collection[int]) -> None:
        """Drop every version not in `versions` (those the store still lists)."""
        with self._lock:
            for v in [v for v in self._verified if v not in versions]:
                del self._verified[v]

    def __len__(self) -> int:
        with self._lock:
            return len(self._verified)
