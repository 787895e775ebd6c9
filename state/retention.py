"""Retention: delete what no kept manifest references, as policies decide.

A policy names the versions it keeps (`KeepLast`, `KeepEvery`, `KeepVersions`);
retention keeps their union, and whatever the policies say it keeps the newest two
valid versions and the newest one whose arrays verify. Manifests go first, so a version
stops being visible before any of its arrays is removed. Then every array no kept
manifest names is deleted, array by array (state.reachability): a version folder whose
ring slots a newer version still references keeps those slots and loses its model and
optimizer copies. Folders above the newest manifest may be a write in flight and are
never touched. Last, temp files a writer that died left under
manifests/, leases/ and secret/, once older than `PARTIAL_GRACE_S`: a live writer's (the
heartbeat's, the next commit's manifest) are newer.

Every manifest is verified before anything is deleted: read every time, verified the
first time its bytes are seen (`state.manifest_cache`), so a commit verifies only its
own. One that fails (damaged, or of a format this library does not read) stops
retention (`OnDamage.STOP`): its arrays may be all that is left to repair it from, and
they would look unreferenced. `OnDamage.DISCARD` deletes such versions instead, only on
explicit request.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from . import hooks
from .errors import CorruptVersionError, FormatVersionError
from .lease import DEFAULT_LEASE_EXPIRY_S
from .manifest import Manifest
from .paths import (
    LEASES,
    MANIFESTS,
    SECRET,
    VERSIONS,
    is_partial,
    manifest_path,
    parse_version_folder,
)
from .reachability import deletion_units, referenced_arrays
from .version import Version

if TYPE_CHECKING:
    from .store import Store

__all__ = [
    "KeepEvery",
    "KeepLast",
    "KeepVersions",
    "OnDamage",
    "RetentionPolicy",
    "retain",
    "verified_manifests",
]

log = logging.getLogger(__name__)

#: Fires before each deletion: a manifest not kept (`what="manifest"`), then a version
#: folder holding no referenced array (`"folder"`) or an unreferenced array, or a group
#: of them, inside a folder that holds referenced ones (`"array"`).
BEFORE_DELETE = hooks.declare(
    "retention.before_delete", "before retention deletes one unreferenced path"
)

#: Retention keeps at least this many of the newest valid versions, whatever policies say.
MIN_KEPT = 2


@runtime_checkable
class RetentionPolicy(Protocol):
    """Names the versions it keeps, from the manifests that verify."""

    def keeps(self, manifests: Mapping[int, Manifest]) -> set[int]:
        """The versions (keys of `manifests`, every one of which parsed and verified)
        this policy keeps."""
        ...


@dataclass(frozen=True, slots=True)
class KeepLast:
    """Keep the `count` newest versions (>= 2: the newest two always stay).

    Attributes:
        count: How many of the newest versions to keep (>= 2).
    """

    count: int = MIN_KEPT

    def __post_init__(self) -> None:
        if self.count < MIN_KEPT:
            raise ValueError(
                f"retain keep_last={self.count} must be >= {MIN_KEPT} (the newest two stay)"
            )

    def keeps(self, manifests: Mapping[int, Manifest]) -> set[int]:
        return set(sorted(manifests)[-self.count :])


@dataclass(frozen=True, slots=True)
class KeepEvery:
    """Keep every version whose step is a multiple of `steps` (>= 1).

    Attributes:
        steps: Keep the versions whose step is a multiple of this (>= 1).
    """

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"retain keep_every={self.steps} must be >= 1 or None")

    def keeps(self, manifests: Mapping[int, Manifest]) -> set[int]:
        return {v for v, m in manifests.items() if m.step % self.steps == 0}


@dataclass(frozen=True, slots=True)
class KeepVersions:
    """Keep the named versions (those that exist).

    Attributes:
        versions: The version numbers to keep.
    """

    versions: frozenset[int]

    def keeps(self, manifests: Mapping[int, Manifest]) -> set[int]:
        return set(self.versions) & set(manifests)


class OnDamage(enum.Enum):
    """What retention does when a manifest fails to verify."""

    STOP = "stop"
    """Delete nothing and raise (the default)."""
    DISCARD = "discard"
    """Delete that version and every array only it references."""


def retain(
    store: Store,
    policies: Sequence[RetentionPolicy] = (KeepLast(),),
    *,
    newest_valid: int | None = None,
    on_damage: OnDamage = OnDamage.STOP,
) -> list[str]:
    """Delete every version no policy keeps, then every array under versions/ no kept
    manifest references (and any version folder left with none), then temp files
    older than `PARTIAL_GRACE_S` (a live writer's are newer).

    Args:
        store: the store (its writer should hold the lease).
        policies: what to keep besides the newest two valid versions and the newest
            version whose arrays verify.
        newest_valid: the newest version known to verify (skips reading it again).
        on_damage: a manifest that fails to verify stops retention, or is discarded.

    Returns:
        The store-relative paths deleted.

    Raises:
        CorruptVersionError: a manifest is damaged (with `OnDamage.STOP`); nothing was
            deleted.
        FormatVersionError: a manifest is of another format (with `OnDamage.STOP`);
            nothing was deleted.
    """
    have = store.versions()
    if not have:
        return []
    manifests = verified_manifests(store, have, on_damage)
    if newest_valid is None:
        newest_valid = _newest_verified(store, manifests)
    keep = set(sorted(manifests)[-MIN_KEPT:])
    if newest_valid is not None:
        keep.add(newest_valid)
    for policy in policies:
        keep |= policy.keeps(manifests)
    backend = store.backend
    deleted: list[str] = []
    for v in have:
        if v not in keep:
            hooks.point(BEFORE_DELETE, version=v, path=manifest_path(v), what="manifest")
            backend.rm(manifest_path(v))
            store.manifest_cache.forget(v)
            deleted.append(manifest_path(v))
    # Only now, with every manifest not kept gone, are arrays deleted: an interrupted
    # run leaves unreferenced arrays (the next run deletes them), never a listed
    # version missing one.
    referenced = referenced_arrays(manifests[v] for v in keep if v in manifests)
    units = deletion_units(
        backend.listdir(VERSIONS), backend.find(VERSIONS), referenced, newest=have[-1]
    )
    for unit in units:
        folder = parse_version_folder(unit.split("/")[1])
        what = "folder" if unit.count("/") == 1 else "array"
        hooks.point(
            BEFORE_DELETE,
            version=None if folder is None else folder.version,
            path=unit,
            what=what,
        )
        backend.rm(unit, recursive=True)
        deleted.append(unit)
    for rel in _partials(store):
        backend.rm(rel)
        deleted.append(rel)
    return deleted


def verified_manifests(store: Store, have: list[int], on_damage: OnDamage) -> dict[int, Manifest]:
    """Every manifest of `have` that parses and verifies; a failing one stops retention
    (or, with `OnDamage.DISCARD`, is left out so that it is deleted). Callers that must
    refuse before writing anything (gc takes the lease first) check with it up front.
    Each is read now; one whose bytes were verified before is not verified again.

    Raises:
        CorruptVersionError, FormatVersionError: with `OnDamage.STOP`, a manifest fails
            to verify; the message says nothing was deleted and how to go on.
    """
    cache = store.manifest_cache
    cache.keep_only(have)
    manifests: dict[int, Manifest] = {}
    for v in have:
        try:
            manifests[v] = cache.manifest(store, v)
        except (CorruptVersionError, FormatVersionError) as exc:
            if on_damage is OnDamage.DISCARD:
                log.warning("retention discards version %d: %s", v, exc)
                continue
            stop = (
                f"{store.url}: retention stopped, nothing was deleted: {exc}; repair or "
                f"move away {manifest_path(v)}, or retain with discard_damaged=True to "
                "delete that version and the arrays only it references"
            )
            if isinstance(exc, CorruptVersionError):
                raise CorruptVersionError(
                    stop, version=exc.version, path=exc.path, record=exc.record
                ) from exc
            raise FormatVersionError(stop) from exc
    return manifests


def _newest_verified(store: Store, manifests: Mapping[int, Manifest]) -> int | None:
    """The newest version whose arrays all verify (retention never deletes it)."""
    for v in sorted(manifests, reverse=True):
        try:
            Version(store, manifests[v]).verify()
        except CorruptVersionError as exc:
            log.warning("retention: version %d does not verify: %s", v, exc)
            continue
        return v
    return None


#: A temp file is left over (a writer died writing it) once it is this old, seconds: a
#: live writer's lives for one small write (a heartbeat, a manifest). Retention runs in
#: the background after a commit, beside the same job's heartbeat and next commit; a sweep
#: of every temp file had deleted the heartbeat's before its rename ("renewing lease ...
#: failed", seen once under load) and could delete the next manifest's before its link,
#: failing that commit. The lease's default expiry: what the store already takes as "a
#: writer not heard from".
PARTIAL_GRACE_S = DEFAULT_LEASE_EXPIRY_S


def _partials(store: Store) -> Iterator[str]:
    """Temp files under manifests/, leases/ and secret/ older than `PARTIAL_GRACE_S`
    (one the storage gives no time for is left: a later sweep may know it)."""
    backend = store.backend
    now = time.time()
    for top in (MANIFESTS, LEASES, SECRET):
        for name in backend.listdir(top):
            if not is_partial(name):
                continue
            written = backend.modified(f"{top}/{name}")
            if written is not None and now - written >= PARTIAL_GRACE_S:
                yield f"{top}/{name}"
