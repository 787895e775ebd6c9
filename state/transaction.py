"""Writing a version: arrays into a fresh folder, then the manifest, created exclusively.

A `Transaction` is the writer holding the lease; a `ShardWriter` is one rank's part of
a multi-process version, committed by the coordinator's transaction. Nothing either
writes is visible until the manifest exists.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from . import hooks
from .arrays import ensure_groups, write_array, written_meta
from .canonical_json import canonical_text, load_bounded
from .errors import CommitConflictError, StoreError
from .lease import Lease
from .manifest import ArrayMeta, Manifest
from .paths import check_name, manifest_path, unsafe_path_reason, version_folder

if TYPE_CHECKING:
    from .store import Store

__all__ = ["ShardWriter", "Transaction"]

BEFORE_ARRAY = hooks.declare("checkpoint.before_array", "before one array of a version is written")
AFTER_ARRAY = hooks.declare("checkpoint.after_array", "after one array of a version is written")
AFTER_ARRAYS = hooks.declare("checkpoint.after_arrays", "after every array of a version is durable")
SHARD_DONE = hooks.declare(
    "checkpoint.shard_done", "multi-process: a rank's arrays are durable, before the barrier"
)
BEFORE_MANIFEST = hooks.declare(
    "checkpoint.before_manifest", "before the manifest (commit record) is written"
)
AFTER_MANIFEST_TEMP = hooks.declare(
    "checkpoint.after_manifest_temp", "local disk: temp manifest durable, not yet linked"
)
AFTER_MANIFEST = hooks.declare(
    "checkpoint.after_manifest", "after the manifest is visible (committed)"
)


def now_iso() -> str:
    """The current UTC time, ISO-8601 (manifests and the store root record it)."""
    return datetime.now(UTC).isoformat()


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
        check_name(name)
        if name in self._arrays:
            raise ValueError(f"version {self.version}: array {name!r} was already put")
        arr = np.asarray(array, order="C")
        hooks.point(BEFORE_ARRAY, name=name, **self._hook_ctx())
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
        meta = written_meta(f"{self.folder}/{name}", arr, checksum, chunks)
        self._arrays[name] = meta
        self.bytes_written += arr.nbytes
        hooks.point(AFTER_ARRAY, name=name, **self._hook_ctx())
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
            folder=version_folder(version, generation, rank),
        )
        self.rank = rank

    def _hook_ctx(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "rank": self.rank}

    def finish(self) -> dict[str, ArrayMeta]:
        """Make this rank's arrays durable; returns them for the coordinator."""
        if self._arrays:
            self.store.backend.fsync_tree(self.folder)
        hooks.point(SHARD_DONE, **self._hook_ctx())
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
            folder=version_folder(version, lease.generation),
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
        check_name(name)
        reason = unsafe_path_reason(meta.path)
        if reason is not None:
            raise ValueError(f"version {self.version}: array {name!r} path {meta.path!r} {reason}")
        if name in self._arrays:
            raise ValueError(f"version {self.version}: array {name!r} was already put")
        self._arrays[name] = meta

    def put_record(self, name: str, record: Any) -> None:
        """A small JSON-serialisable record carried inside the manifest.

        Raises:
            TypeError: something in it is not serialisable.
            NonFiniteError: it holds NaN or an infinity (JSON has neither), named by
                where (a ValueError).
        """
        try:  # fail now, not at commit
            json.dumps(record, allow_nan=False)
        except ValueError:
            canonical_text({"records": {name: record}})  # raises, naming where
            raise
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
        hooks.point(AFTER_ARRAYS, step=self.step, version=self.version)
        self.lease.check()
        manifest = Manifest(
            version=self.version,
            step=self.step,
            parent=self.parent,
            created=now_iso(),
            write_id=uuid.uuid4().hex,
            writer=self.lease.as_record(),
            job_fingerprint=self.job_fingerprint,
            arrays=dict(self._arrays),
            records=dict(self._records),
        )
        if self.store.mac_key is not None:
            manifest, data = manifest.seal(self.store.mac_key)
        else:
            data = manifest.to_bytes()
        path = manifest_path(self.version)
        hooks.point(BEFORE_MANIFEST, step=self.step, version=self.version)

        try:
            backend.create_once(
                path,
                data,
                on_temp_durable=lambda: hooks.point(
                    AFTER_MANIFEST_TEMP, step=self.step, version=self.version
                ),
            )
        except FileExistsError:
            try:
                writer = load_bounded(backend.read_bytes(path)).get("writer")
            except (OSError, ValueError, AttributeError, StoreError):  # not one, a FIFO
                writer = "unknown"
            raise CommitConflictError(
                f"{backend.url}: version {self.version} was committed by another writer "
                f"({writer}); this commit is refused"
            ) from None
        self.committed = manifest
        self.store.manifest_cache.remember(self.version, data, backend.url)
        hooks.point(AFTER_MANIFEST, step=self.step, version=self.version)
        return manifest
