"""The versioned store: begin a version, put arrays and records, commit atomically."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import fsspec
import numpy as np

from . import hooks
from .arrays import ensure_groups, read_array, write_array
from .backend import Backend
from .errors import (
    CommitConflictError,
    CorruptVersionError,
    FormatVersionError,
    NotAStoreError,
    StoreError,
    StoreNotFoundError,
    UnsafePathError,
    VersionNotFoundError,
)
from .lease import DEFAULT_LEASE_EXPIRY_S, Lease, acquire_lease, current_holder
from .manifest import FORMAT_VERSION, ArrayMeta, Manifest, manifest_path, unsafe_path_reason
from .retry import RetryPolicy

__all__ = ["Store", "Transaction", "Version"]

log = logging.getLogger("state.store")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_ATTR = "cocoon_ckpt"
_READ_THREADS = 8


def _check_name(name: str) -> None:
    if not _NAME.match(name) or ".." in name.split("/"):
        raise ValueError(
            f"array name {name!r} must be '/'-separated parts of letters, digits, '_', '.', '-'"
        )


def _now() -> str:
    return datetime.now(UTC).isoformat()


class Version:
    """One committed version, read back. Arrays load on first access and are verified."""

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self._cache: dict[str, np.ndarray] = {}

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def records(self) -> dict[str, Any]:
        return self.manifest.records

    def array_names(self) -> list[str]:
        return sorted(self.manifest.arrays)

    def array(self, name: str) -> np.ndarray:
        """The array `name`, checked against the manifest's shape, dtype and checksum.

        Raises:
            KeyError: the version has no array `name`.
            CorruptVersionError: it is missing, truncated or fails its checksum.
        """
        if name in self._cache:
            return self._cache[name]
        meta = self.manifest.arrays[name]
        arr = self.store._read_verified(self.version, name, meta)
        self._cache[name] = arr
        return arr

    def verify(self) -> None:
        """Read and check every array (raises CorruptVersionError on the first bad one,
        in name order).

        Arrays are read by a few threads at once: file reads and crc32c release the
        GIL, and a cold restore is bound by read latency, which overlapping hides.
        """
        names = self.array_names()
        with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            futures = [pool.submit(self.array, n) for n in names]
        for fut in futures:
            fut.result()

    def __repr__(self) -> str:
        return f"Version({self.version}, step={self.step}, arrays={len(self.manifest.arrays)})"


class _VersionWriter:
    """Writes arrays of version `version` into one folder; write-once paths."""

    def __init__(self, store: Store, *, version: int, step: int, folder: str) -> None:
        self.store = store
        self.version = version
        self.step = step
        self.folder = folder
        self._arrays: dict[str, ArrayMeta] = {}
        self._groups: set[str] = set()  # zarr group metadata already written
        self.bytes_written = 0

    def _hook_ctx(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version}

    def put_array(self, name: str, array: np.ndarray) -> ArrayMeta:
        """Write `array` as part of this version under logical name `name`.

        The write is retried on transient errors: the path is new and write-once, so
        rewriting it is idempotent.
        """
        _check_name(name)
        if name in self._arrays:
            raise ValueError(f"version {self.version}: array {name!r} was already put")
        arr = np.asarray(array, order="C")
        hooks.point("checkpoint.before_array", name=name, **self._hook_ctx())
        backend = self.store.backend

        def write() -> tuple[str, tuple[int, ...]]:
            ensure_groups(backend, self.folder, name, self._groups)
            try:
                return write_array(backend, self.folder, name, arr)
            except FileExistsError:
                # a try that failed half-way left part of the array: start it afresh
                backend.rm(f"{self.folder}/{name}", recursive=True)
                return write_array(backend, self.folder, name, arr)

        checksum, chunks = self.store.retry.call(write)
        meta = ArrayMeta(
            path=f"{self.folder}/{name}",
            shape=tuple(arr.shape),
            dtype=str(arr.dtype),
            checksum=checksum,
            chunks=chunks,
        )
        self._arrays[name] = meta
        self.bytes_written += arr.nbytes
        hooks.point("checkpoint.after_array", name=name, **self._hook_ctx())
        return meta


class ShardWriter(_VersionWriter):
    """One rank's part of version `version` of a multi-process job: its arrays go into
    their own folder (`versions/<v>-g<gen>-r<rank>`), so ranks never write the same
    file; the coordinator references them in the manifest it commits. Nothing a shard
    writer writes is visible until then, and a folder no manifest references is
    removed by retention."""

    def __init__(self, store: Store, *, version: int, step: int, generation: int, rank: int):
        super().__init__(
            store,
            version=version,
            step=step,
            folder=f"versions/{version:08d}-g{generation}-r{rank:04d}",
        )
        self.rank = rank

    def _hook_ctx(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "rank": self.rank}

    def finish(self) -> dict[str, ArrayMeta]:
        """Make this rank's arrays durable; returns them for the coordinator."""
        if self._arrays:
            self.store.backend.fsync_tree(self.folder)
        hooks.point("checkpoint.shard_done", **self._hook_ctx())
        return dict(self._arrays)


class Transaction(_VersionWriter):
    """Builds version `version`; nothing is visible until `commit()` writes the manifest."""

    def __init__(
        self,
        store: Store,
        *,
        version: int,
        step: int,
        parent: int | None,
        lease: Lease,
        job_fingerprint: str | None = None,
    ):
        super().__init__(
            store,
            version=version,
            step=step,
            folder=f"versions/{version:08d}-g{lease.generation}",
        )
        self.job_fingerprint = job_fingerprint
        self.parent = parent
        self.lease = lease
        self._records: dict[str, Any] = {}
        self.committed: Manifest | None = None

    def reference(self, name: str, meta: ArrayMeta) -> None:
        """Include an array written earlier (an older version's, or shared) by path.

        Raises:
            ValueError: `meta.path` is not confined to the store (readers would refuse it).
        """
        _check_name(name)
        reason = unsafe_path_reason(meta.path)
        if reason is not None:
            raise ValueError(f"version {self.version}: array {name!r} path {meta.path!r} {reason}")
        if name in self._arrays:
            raise ValueError(f"version {self.version}: array {name!r} was already put")
        self._arrays[name] = meta

    def put_record(self, name: str, record: Any) -> None:
        """A small JSON-serialisable record carried inside the manifest."""
        json.dumps(record)  # fail now, not at commit, on something not serialisable
        self._records[name] = record

    def commit(self) -> Manifest:
        """Make the version visible: fsync the arrays, check the lease, create the
        manifest exclusively. A crash anywhere before the manifest exists leaves the
        previous version as the newest.

        Raises:
            FencedError: the lease was taken over.
            CommitConflictError: another writer created this version number.
        """
        if self.committed is not None:
            return self.committed
        backend = self.store.backend
        if self._arrays:
            backend.fsync_tree(self.folder)
        hooks.point("checkpoint.after_arrays", step=self.step, version=self.version)
        self.lease.check()
        manifest = Manifest(
            version=self.version,
            step=self.step,
            parent=self.parent,
            created=_now(),
            write_id=uuid.uuid4().hex,
            writer=self.lease.as_record(),
            job_fingerprint=self.job_fingerprint,
            arrays=dict(self._arrays),
            records=dict(self._records),
        )
        data = manifest.to_bytes()
        path = manifest_path(self.version)
        hooks.point("checkpoint.before_manifest", step=self.step, version=self.version)

        try:
            backend.create_once(
                path,
                data,
                on_temp_durable=lambda: hooks.point(
                    "checkpoint.after_manifest_temp", step=self.step, version=self.version
                ),
            )
        except FileExistsError:
            try:
                writer = json.loads(backend.read_bytes(path)).get("writer")
            except (OSError, ValueError):
                writer = "unknown"
            raise CommitConflictError(
                f"{backend.url}: version {self.version} was committed by another writer "
                f"({writer}); this commit is refused"
            ) from None
        self.committed = manifest
        hooks.point("checkpoint.after_manifest", step=self.step, version=self.version)
        return manifest


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
                (a file, a non-empty folder, a zarr v2 store, a plain zarr v3 group);
                nothing is written or chmod'ed.
        """
        store = cls(Backend(url, storage_options, fs=fs, retry=retry), retry=retry)
        backend = store.backend
        if backend.local and os.path.exists(backend.root) and not os.path.isdir(backend.root):
            raise NotAStoreError(
                f"{url} is a file, not a cocoon-ckpt store; give the path of a store, or of a "
                "new or empty folder to create one in"
            )
        raw = store._read_root()
        if raw is None:
            if not create:
                raise StoreNotFoundError(
                    f"{url} holds no cocoon-ckpt store (no zarr.json at its root); check the "
                    "URL, or run a job against it first to create one"
                )
            # Everything that can refuse is checked before the first write or chmod.
            foreign = store._foreign_entries()
            raw = store._read_root() if foreign else None  # a racing creator finished
            if raw is None and foreign:
                raise NotAStoreError(f"{url} {_describe_foreign(foreign)}")
        if raw is None:
            store._initialise(attributes or {})
        else:
            store._load_root(raw)
        return store

    def _read_root(self) -> bytes | None:
        try:
            return self.backend.read_bytes("zarr.json")
        except FileNotFoundError:
            return None

    def _foreign_entries(self) -> list[str]:
        """What lies at the location besides an unfinished store skeleton (the folders
        `_initialise` creates, and its temp files, left by a creator that crashed or is
        still running)."""
        b = self.backend
        out: list[str] = []
        for name in b.listdir(""):
            if name in _SKELETON:
                out.extend(
                    f"{name}/{sub}"
                    for sub in b.listdir(name)
                    if sub not in _SKELETON[name] and not _is_temp(sub)
                )
            elif not _is_temp(name):
                out.append(name)
        return out

    def _initialise(self, attributes: dict[str, Any]) -> None:
        b = self.backend
        b.makedirs("", private=True)
        b.chmod_private("")
        attrs = {
            _ATTR: {"format_version": FORMAT_VERSION, "created": _now(), **attributes},
        }
        group = {"zarr_format": 3, "node_type": "group", "attributes": {}}
        for sub in ("versions", "shared"):
            b.makedirs(sub)
            if not b.exists(f"{sub}/zarr.json"):
                b.write_once(f"{sub}/zarr.json", json.dumps(group).encode())
        b.makedirs("manifests")
        b.makedirs("leases")
        root = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
        # The root metadata goes last: its presence says the skeleton is complete.
        try:
            b.create_once("zarr.json", json.dumps(root, indent=1).encode())
        except FileExistsError:
            self._load_root(b.read_bytes("zarr.json"))
            return
        self.attributes = attrs[_ATTR]

    def _load_root(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
            attrs = doc["attributes"][_ATTR]
        except (ValueError, KeyError, TypeError) as exc:
            raise NotAStoreError(
                f"{self.backend.url} holds a zarr.json that is not a cocoon-ckpt store root "
                f"(a plain zarr group or array: no '{_ATTR}' attributes); it is left as it "
                "is: point at a cocoon-ckpt store, or at a new or empty folder"
            ) from exc
        fv = attrs.get("format_version")
        if not isinstance(fv, int) or fv > FORMAT_VERSION:
            raise FormatVersionError(
                f"{self.backend.url}: store format version {fv!r} is newer than this library "
                f"reads ({FORMAT_VERSION}); upgrade cocoon-ckpt to open it"
            )
        self.attributes = dict(attrs)

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def job_fingerprint(self) -> str | None:
        fp = self.attributes.get("job_fingerprint")
        return str(fp) if fp is not None else None

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
        _check_name(name)
        self.backend.makedirs("secret", private=True)
        self.backend.chmod_private("secret")
        try:
            self.backend.create_once(f"secret/{name}", data)
        except FileExistsError:
            if self.backend.read_bytes(f"secret/{name}") != data:
                raise StoreError(
                    f"{self.url}: secret/{name} exists with other contents; it is never overwritten"
                ) from None
        self.backend.chmod_private(f"secret/{name}")

    def get_secret(self, name: str) -> bytes | None:
        try:
            return self.backend.read_bytes(f"secret/{name}")
        except FileNotFoundError:
            return None

    # shared, job-lifetime arrays -------------------------------------------------
    def put_shared(self, name: str, array: np.ndarray) -> ArrayMeta:
        """Write a job-lifetime array under shared/ once; versions reference it."""
        _check_name(name)
        arr = np.asarray(array, order="C")

        def write() -> tuple[str, tuple[int, ...]]:
            ensure_groups(self.backend, "shared", name, {"shared"})
            return write_array(self.backend, "shared", name, arr)

        checksum, chunks = self.retry.call(write)
        self.backend.fsync_tree(f"shared/{name}")
        return ArrayMeta(
            path=f"shared/{name}",
            shape=tuple(arr.shape),
            dtype=str(arr.dtype),
            checksum=checksum,
            chunks=chunks,
        )

    # versions --------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Numbers of every version whose manifest exists, oldest first (unverified)."""
        out = []
        for name in self.backend.listdir("manifests"):
            stem = name[:-5] if name.endswith(".json") else ""
            if stem.isdigit() and len(stem) == 8:
                out.append(int(stem))
        return sorted(out)

    def manifest(self, version: int) -> Manifest:
        """Parse version `version`'s manifest (arrays not checked).

        Raises:
            VersionNotFoundError: no such version.
            CorruptVersionError: the manifest is torn or malformed.
        """
        try:
            data = self.backend.read_bytes(manifest_path(version))
        except FileNotFoundError:
            have = self.versions()
            raise VersionNotFoundError(
                f"{self.url} has no version {version}; it has {_describe(have)}"
            ) from None
        return Manifest.from_bytes(data, version=version, where=self.url)

    def read(self, version: int, *, verify: bool = True) -> Version:
        """Version `version`; with `verify`, every array is read and checked now."""
        v = Version(self, self.manifest(version))
        if verify:
            v.verify()
        return v

    def latest(self, *, verify: bool = True, allow_fallback: bool = False) -> Version | None:
        """The newest version that parses and verifies; None for an empty store.

        Args:
            verify: read and check every array of the candidate.
            allow_fallback: if the newest is damaged, log it and try older ones;
                otherwise raise.

        Raises:
            CorruptVersionError: the newest is damaged and fallback is not allowed, or
                every version is damaged.
        """
        errors: list[CorruptVersionError] = []
        for v in reversed(self.versions()):
            try:
                return self.read(v, verify=verify)
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

    def _read_verified(self, version: int, name: str, meta: ArrayMeta) -> np.ndarray:
        where = f"version {version} of {self.url}: array {meta.path}"
        self._check_confined(version, name, meta)
        # The zarr group an array was written into: versions/<folder> or shared.
        top = meta.path.split("/")
        base = "/".join(top[:2]) if top[0] == "versions" else top[0]
        sub = meta.path[len(base) + 1 :]
        try:
            layout = None if meta.chunks is None else (meta.shape, meta.dtype, meta.chunks)
            arr, got = self.retry.call(lambda: read_array(self.backend, base, sub, layout))
        except Exception as exc:  # zarr raises many kinds for a missing/torn chunk
            raise CorruptVersionError(
                f"{where} cannot be read ({type(exc).__name__}: {exc}); it is missing or torn",
                version=version,
                path=meta.path,
            ) from exc
        if tuple(arr.shape) != meta.shape or str(arr.dtype) != meta.dtype:
            raise CorruptVersionError(
                f"{where} is {arr.dtype}{list(arr.shape)}, manifest says {meta.dtype}{list(meta.shape)}",
                version=version,
                path=meta.path,
            )
        if got != meta.checksum:
            raise CorruptVersionError(
                f"{where} checksum mismatch ({got} != {meta.checksum})",
                version=version,
                path=meta.path,
            )
        return arr

    def _check_confined(self, version: int, name: str, meta: ArrayMeta) -> None:
        """Refuse an array path that leaves the store: by its form (every backend), and
        on local disk by where its folder and every link inside it resolve.

        Raises:
            UnsafePathError: naming the version, the array and the path.
        """

        def refuse(reason: str) -> UnsafePathError:
            return UnsafePathError(
                f"version {version} of {self.url}: array {name!r} has path {meta.path!r}, "
                f"which {reason}; a manifest may name only arrays inside its own store, so "
                "this version is refused",
                version=version,
                path=meta.path,
                array=name,
            )

        reason = unsafe_path_reason(meta.path)
        if reason is not None:
            raise refuse(reason)
        if not self.backend.local:
            return
        escaped = _escaping_link(os.path.realpath(self.backend.root), self.backend.path(meta.path))
        if escaped is not None:
            raise refuse(f"resolves outside the store root through {escaped}")

    # retention -------------------------------------------------------------------
    def retain(
        self,
        *,
        keep_last: int = 2,
        keep_every: int | None = None,
        newest_valid: int | None = None,
        discard_damaged: bool = False,
    ) -> list[str]:
        """Delete what no kept manifest references.

        Keeps the `keep_last` newest versions (>= 2), every version whose step is a
        multiple of `keep_every`, and the newest valid version (found by verifying,
        unless the caller names it as `newest_valid`). Manifests go first, so a version
        stops being visible before any of its arrays is removed.

        Every manifest is verified before anything is deleted. One that fails (damaged,
        or of a format this library does not read) stops retention: its arrays may be
        all that is left to repair it from, and they would look unreferenced.

        Args:
            keep_last: how many of the newest verifiable versions to keep (>= 2).
            keep_every: also keep every version whose step is a multiple of this.
            newest_valid: the newest version known to verify (skips reading it again).
            discard_damaged: delete versions whose manifest fails to verify, and every
                array only they reference, instead of stopping. Only on explicit request.

        Returns:
            The store-relative paths deleted.

        Raises:
            CorruptVersionError: a manifest is damaged (and `discard_damaged` is off);
                nothing was deleted.
            FormatVersionError: a manifest is of another format (and `discard_damaged`
                is off); nothing was deleted.
        """
        if keep_last < 2:
            raise ValueError(f"retain keep_last={keep_last} must be >= 2 (the newest two stay)")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"retain keep_every={keep_every} must be >= 1 or None")
        have = self.versions()
        if not have:
            return []
        manifests: dict[int, Manifest] = {}
        for v in have:
            try:
                manifests[v] = self.manifest(v)
            except (CorruptVersionError, FormatVersionError) as exc:
                if discard_damaged:
                    log.warning("retention discards version %d: %s", v, exc)
                    continue
                stop = (
                    f"{self.url}: retention stopped, nothing was deleted: {exc}; repair or "
                    f"move away {manifest_path(v)}, or retain with discard_damaged=True to "
                    "delete that version and the arrays only it references"
                )
                if isinstance(exc, CorruptVersionError):
                    raise CorruptVersionError(
                        stop, version=exc.version, path=exc.path, record=exc.record
                    ) from exc
                raise FormatVersionError(stop) from exc
        valid = sorted(manifests)
        if newest_valid is None:
            newest_valid = self._newest_verified(valid, manifests)
        keep = set(valid[-keep_last:])
        if newest_valid is not None:
            keep.add(newest_valid)
        if keep_every:
            keep |= {v for v in valid if manifests[v].step % keep_every == 0}
        deleted: list[str] = []
        for v in have:
            if v not in keep:
                hooks.point("retention.before_delete", version=v, path=manifest_path(v))
                self.backend.rm(manifest_path(v))
                deleted.append(manifest_path(v))
        referenced = {
            "/".join(meta.path.split("/")[:2])
            for v in keep
            if v in manifests
            for meta in manifests[v].arrays.values()
            if meta.path.startswith("versions/")
        }
        newest = have[-1]
        for folder in self.backend.listdir("versions"):
            if folder == "zarr.json" or f"versions/{folder}" in referenced:
                continue
            num = folder.split("-", 1)[0]
            # Folders above the newest manifest may be a write in flight: never touch.
            if num.isdigit() and int(num) > newest:
                continue
            hooks.point(
                "retention.before_delete",
                version=int(num) if num.isdigit() else None,
                path=f"versions/{folder}",
            )
            self.backend.rm(f"versions/{folder}", recursive=True)
            deleted.append(f"versions/{folder}")
        for rel in self._partials():
            self.backend.rm(rel)
            deleted.append(rel)
        return deleted

    def _newest_verified(self, valid: list[int], manifests: dict[int, Manifest]) -> int | None:
        """The newest of `valid` whose arrays all verify (retention never deletes it)."""
        for v in reversed(valid):
            try:
                Version(self, manifests[v]).verify()
            except CorruptVersionError as exc:
                log.warning("retention: version %d does not verify: %s", v, exc)
                continue
            return v
        return None

    def _partials(self) -> Iterator[str]:
        for top in ("manifests", "leases", "secret"):
            for name in self.backend.listdir(top):
                if name.endswith(".partial"):
                    yield f"{top}/{name}"


def _escaping_link(root: str, top: str) -> str | None:
    """The first of `top` and the links under it that resolves outside `root` (both
    real paths are compared), or None. Links to folders inside the store are followed."""
    seen: set[str] = set()
    pending = [top]
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


#: The skeleton `_initialise` writes before the root zarr.json: folder -> its files.
_SKELETON: dict[str, set[str]] = {
    "versions": {"zarr.json"},
    "shared": {"zarr.json"},
    "manifests": set(),
    "leases": set(),
}


def _is_temp(name: str) -> bool:
    return name.startswith("zarr.json.") and name.endswith(".partial")


def _describe_foreign(entries: list[str]) -> str:
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} in all)" if len(entries) > 5 else "")
    if any(e.rsplit("/", 1)[-1] in (".zgroup", ".zarray", ".zattrs") for e in entries):
        kind = "holds a zarr v2 store"
    else:
        kind = "is a non-empty folder"
    return (
        f"{kind}, not a cocoon-ckpt store (it holds {shown}); nothing was written: point at a "
        "cocoon-ckpt store, or at a new or empty folder to create one"
    )


def _describe(have: list[int]) -> str:
    if not have:
        return "no versions yet"
    return f"versions {have[0]}..{have[-1]} ({len(have)} in all)"
