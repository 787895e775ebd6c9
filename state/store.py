"""The versioned store: open or create it, list and read versions, begin a new one.

Writing goes through a `Transaction` (state.transaction), reading through a `Version`
(state.version), deleting through retention (state.retention); on-disk names are
state.paths'. A store is opened on any `Backend` (state.backend).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import fsspec
import numpy as np

from .arrays import ensure_groups, write_array, written_meta
from .backend import Backend
from .errors import (
    CorruptVersionError,
    NotAStoreError,
    StoreError,
    StoreNotFoundError,
    UnsafeFileError,
    VersionNotFoundError,
)
from .lease import DEFAULT_LEASE_EXPIRY_S, Lease, acquire_lease, current_holder
from .manifest import MAC_KEY_BYTES, ArrayMeta, Manifest
from .manifest_cache import ManifestCache, refused_manifest
from .open import open_backend
from .paths import (
    MANIFESTS,
    SECRET,
    SHARED,
    check_name,
    manifest_path,
    parse_manifest_name,
    secret_path,
    shared_path,
)
from .reachability import Space, space
from .retention import KeepEvery, KeepLast, OnDamage, RetentionPolicy, retain
from .retry import RetryPolicy
from .root import (
    describe_foreign,
    foreign_entries,
    initialise,
    load_root,
    read_root,
    refuse_nested,
)
from .transaction import ShardWriter, Transaction, now_iso
from .version import Version

__all__ = ["Store"]

log = logging.getLogger(__name__)


class Store:
    """A cocoon-ckpt store at an fsspec URL.

    Use `Store.open(url)`; then `acquire_lease()` and `begin(step)` to write, or
    `latest()` / `read(v)` to read.
    """

    def __init__(self, backend: Backend, *, retry: RetryPolicy | None = None) -> None:
        self.backend = backend
        self.retry = backend.retry if retry is None else retry
        self.lease: Lease | None = None
        self.attributes: dict[str, Any] = {}
        #: Manifests retention has verified, trusted while their bytes are unchanged.
        self.manifest_cache = ManifestCache()
        #: See `authenticate_with`.
        self.mac_key: bytes | None = None
        self.require_macs = True

    # opening ---------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        create: bool = True,
        fs: fsspec.AbstractFileSystem | None = None,
        retry: RetryPolicy | None = None,
        attributes: dict[str, Any] | None = None,
    ) -> Store:
        """Open (and with `create`, initialise) the store at `url`.

        Args:
            url: local path or fsspec URL.
            storage_options: fsspec options (credentials, endpoint_url, ...).
            create: initialise an empty location; otherwise a missing store raises.
            fs: a filesystem instance to use (e.g. the fault injector's wrapper).
            retry: retry policy for transient errors.
            attributes: extra root attributes recorded when the store is created.

        Raises:
            StoreNotFoundError: nothing is there and `create` is False.
            FormatVersionError: the store is of a newer format.
            NotAStoreError: the location holds something that is not a cocoon-ckpt store
                (a file, a non-empty folder, a zarr v2 store, a plain zarr v3 group), or
                lies inside another store's tree (local paths); nothing is written or
                chmod'ed.
        """
        store = cls(open_backend(url, storage_options, fs=fs, retry=retry), retry=retry)
        backend = store.backend
        # fsspec keeps one S3 filesystem per process, listings cached: a store opened
        # after other processes wrote to it must not read this process's older listing
        # (s3fs forgets a path and its parents, not its children: forget it all)
        backend.invalidate()
        refuse_nested(backend)
        if backend.root_is_file():
            raise NotAStoreError(
                f"{url} is a file, not a cocoon-ckpt store; give the path of a store, or of a "
                "new or empty folder to create one in"
            )
        raw = read_root(backend)
        if raw is None:
            if not create:
                raise StoreNotFoundError(
                    f"{url} holds no cocoon-ckpt store (no zarr.json at its root); check the "
                    "URL, or run a job against it first to create one"
                )
            # Everything that can refuse is checked before the first write or chmod.
            foreign = foreign_entries(backend)
            raw = read_root(backend) if foreign else None  # a racing creator finished
            if raw is None and foreign:
                raise NotAStoreError(describe_foreign(url, foreign))
        if raw is None:
            store.attributes = initialise(backend, attributes or {}, now_iso())
        else:
            store.attributes = load_root(backend, raw)
        return store

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def job_fingerprint(self) -> str | None:
        fp = self.attributes.get("job_fingerprint")
        return str(fp) if fp is not None else None

    def authenticate_with(self, mac_key: bytes, *, require: bool = True) -> None:
        """From now on, seal every commit with `mac_key` and verify every manifest read
        through `manifest`, `read` and `latest` with it: a MAC that fails raises
        ForgedVersionError (a CorruptVersionError, so `latest(allow_fallback=True)`
        passes over it like any damaged version). With `require`, a version without MACs
        raises UnauthenticatedVersionError; without it, such a version is read as
        before (`Manifest.sealed` tells). Retention verifies checksums only: whoever can
        forge a manifest can delete files anyway."""
        if len(mac_key) != MAC_KEY_BYTES:
            raise ValueError(f"a manifest MAC key is {MAC_KEY_BYTES} bytes, not {len(mac_key)}")
        self.mac_key = mac_key
        self.require_macs = require

    # leases ----------------------------------------------------------------------
    def acquire_lease(
        self, *, takeover: bool = False, expiry_s: float = DEFAULT_LEASE_EXPIRY_S
    ) -> Lease:
        """Become this store's one writer (see `state.lease.acquire_lease`)."""
        self.lease = acquire_lease(self.backend, takeover=takeover, expiry_s=expiry_s)
        return self.lease

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def lease_holder(self) -> dict[str, Any] | None:
        return current_holder(self.backend)

    # secrets ---------------------------------------------------------------------
    def put_secret(self, name: str, data: bytes) -> None:
        """Write an owner-only file `secret/<name>` once (0600 in a 0700 folder)."""
        check_name(name)
        path = secret_path(name)
        self.backend.makedirs(SECRET, private=True)
        self.backend.chmod_private(SECRET)
        try:
            self.backend.create_once(path, data)
        except FileExistsError:
            if self.backend.read_bytes(path) != data:
                raise StoreError(
                    f"{self.url}: {path} exists with other contents; it is never overwritten"
                ) from None
        self.backend.chmod_private(path)

    def get_secret(self, name: str) -> bytes | None:
        try:
            return self.backend.read_bytes(secret_path(name))
        except FileNotFoundError:
            return None

    # shared, job-lifetime arrays -------------------------------------------------
    def put_shared(self, name: str, array: np.ndarray) -> ArrayMeta:
        """Write a job-lifetime array under shared/ once; versions reference it."""
        check_name(name)
        arr = np.asarray(array, order="C")

        def write() -> tuple[str, tuple[int, ...]]:
            ensure_groups(self.backend, SHARED, name, {SHARED})
            return write_array(self.backend, SHARED, name, arr)

        checksum, chunks = self.retry.call(write)
        path = shared_path(name)
        self.backend.fsync_tree(path)
        return written_meta(path, arr, checksum, chunks)

    # versions --------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Numbers of every version whose manifest exists, oldest first (unverified)."""
        found = (parse_manifest_name(n) for n in self.backend.listdir(MANIFESTS))
        return sorted(v for v in found if v is not None)

    def manifest(self, version: int) -> Manifest:
        """Parse version `version`'s manifest (arrays not checked).

        Raises:
            VersionNotFoundError: no such version.
            CorruptVersionError: the manifest is torn or malformed, not a regular file,
                or a link out of the store; with a MAC key (`authenticate_with`),
                forged (ForgedVersionError) or without MACs (UnauthenticatedVersionError).
        """
        try:
            data = self.backend.read_bytes(manifest_path(version))
        except FileNotFoundError:
            have = self.versions()
            raise VersionNotFoundError(
                f"{self.url} has no version {version}; it has {_describe(have)}"
            ) from None
        except UnsafeFileError as exc:  # a FIFO, or a link out of the store
            raise refused_manifest(exc, version) from exc
        manifest = Manifest.from_bytes(data, version=version, where=self.url)
        if self.mac_key is not None and (manifest.sealed or self.require_macs):
            manifest.authenticate(self.mac_key, where=self.url)
        return manifest

    def read(
        self, version: int, *, verify: bool = True, stream: Callable[[str], bool] | None = None
    ) -> Version:
        """Version `version`; with `verify`, every array is read and checked now (those
        `stream` names by a streamed pass: `Version.verify`)."""
        v = Version(self, self.manifest(version))
        if verify:
            v.verify(stream)
        return v

    def latest(
        self,
        *,
        verify: bool = True,
        allow_fallback: bool = False,
        stream: Callable[[str], bool] | None = None,
    ) -> Version | None:
        """The newest version that parses and verifies; None for an empty store.

        Args:
            verify: read and check every array of the candidate.
            stream: the arrays the caller reads in pieces, if not read whole
                (`Version.verify`).
            allow_fallback: if the newest is damaged, log it and try older ones;
                otherwise raise.

        Raises:
            CorruptVersionError: the newest is damaged and fallback is not allowed, or
                every version is damaged.
        """
        errors: list[CorruptVersionError] = []
        for v in reversed(self.versions()):
            try:
                return self.read(v, verify=verify, stream=stream)
            except CorruptVersionError as exc:
                if not allow_fallback:
                    older = [x for x in self.versions() if x < v]
                    hint = (
                        f"; open with allow_fallback=True to use version {older[-1]}"
                        if older
                        else "; no older version exists"
                    )
                    exc.args = (str(exc) + hint,)  # same class, version, path and record
                    raise
                log.warning("skipping damaged version: %s", exc)
                errors.append(exc)
        if errors:
            raise CorruptVersionError(
                f"{self.url}: every version is damaged: " + "; ".join(str(e) for e in errors),
                version=errors[-1].version,
                path=errors[-1].path,
                record=errors[-1].record,
            )
        return None

    # writing ---------------------------------------------------------------------
    def shard_writer(self, version: int, step: int, generation: int, rank: int) -> ShardWriter:
        """Rank `rank`'s writer of version `version`, which the coordinator (holding the
        lease of `generation`) begins and commits. Needs no lease itself."""
        w = ShardWriter(self, version=version, step=step, generation=generation, rank=rank)
        if self.backend.exists(w.folder):  # an earlier failed try at this number
            self.backend.rm(w.folder, recursive=True)
        return w

    def begin(
        self, step: int, *, parent: int | None = None, job_fingerprint: str | None = None
    ) -> Transaction:
        """Start version (newest + 1) holding the state after `step` steps.

        `job_fingerprint` goes into the manifest (default: the store root's, if any).

        Raises:
            StoreError: no lease is held (call `acquire_lease()` first).
        """
        if self.lease is None:
            raise StoreError(f"{self.url}: begin() needs the writer lease; call acquire_lease()")
        self.lease.check()
        have = self.versions()
        version = (have[-1] + 1) if have else 1
        txn = Transaction(
            self,
            version=version,
            step=step,
            parent=parent,
            lease=self.lease,
            job_fingerprint=job_fingerprint or self.job_fingerprint,
        )
        if self.backend.exists(txn.folder):  # our own earlier failed try at this number
            self.backend.rm(txn.folder, recursive=True)
        return txn

    # retention -------------------------------------------------------------------
    def retain(
        self,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        newest_valid: int | None = None,
        discard_damaged: bool = False,
        policies: Sequence[RetentionPolicy] = (),
    ) -> list[str]:
        """Delete what no kept manifest references (see state.retention).

        Keeps the `keep_last` newest versions (>= 2), every version whose step is a
        multiple of `keep_every`, the newest valid version (found by verifying, unless
        the caller names it as `newest_valid`), and what any of `policies` keeps.
        Every manifest is verified before anything is deleted; one that fails stops
        retention unless `discard_damaged`.

        Args:
            keep_last: how many of the newest verifiable versions to keep (>= 2).
            keep_every: also keep every version whose step is a multiple of this.
            newest_valid: the newest version known to verify (skips reading it again).
            discard_damaged: delete versions whose manifest fails to verify, and every
                array only they reference, instead of stopping. Only on explicit request.
            policies: further retention policies (`KeepVersions`, your own).

        Returns:
            The store-relative paths deleted.

        Raises:
            CorruptVersionError: a manifest is damaged (and `discard_damaged` is off);
                nothing was deleted.
            FormatVersionError: a manifest is of another format (and `discard_damaged`
                is off); nothing was deleted.
        """
        chosen: list[RetentionPolicy] = [KeepLast(keep_last)]
        if keep_every is not None:
            chosen.append(KeepEvery(keep_every))
        chosen.extend(policies)
        return retain(
            self,
            chosen,
            newest_valid=newest_valid,
            on_damage=OnDamage.DISCARD if discard_damaged else OnDamage.STOP,
        )

    def space(self) -> Space:
        """Bytes on disk by what the manifests reach: `referenced` (arrays some manifest
        names), `unreachable` (what `retain` deletes once no manifest needs it),
        `in_flight`, `scaffolding` and the totals (see
        `state.reachability.Space`). Reads every manifest and lists the store once."""
        return space(self)


def _describe(have: list[int]) -> str:
    if not have:
        return "no versions yet"
    return f"versions {have[0]}..{have[-1]} ({len(have)} in all)"
