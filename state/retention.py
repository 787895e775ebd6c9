"""Retention: delete what no kept manifest references, as policies decide.

A policy names the versions it keeps (`KeepLast`, `KeepEvery`, `KeepVersions`);
retention keeps their union, and whatever the policies say it keeps the newest two
valid versions and the newest one whose arrays verify. Manifests go first, so a version
stops being visible before any of its arrays is removed; folders above the newest
manifest may be a write in flight and are never touched.

Every manifest is verified before anything is deleted. One that fails (damaged, or of a
format this library does not read) stops retention (`OnDamage.STOP`): its arrays may be
all that is left to repair it from, and they would look unreferenced. `OnDamage.DISCARD`
deletes such versions instead, only on explicit request.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from . import hooks
from .errors import CorruptVersionError, FormatVersionError
from .manifest import Manifest
from .paths import (
    LEASES,
    MANIFESTS,
    ROOT_META,
    SECRET,
    VERSIONS,
    is_partial,
    manifest_path,
    parse_version_folder,
)
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

log = logging.getLogger("state.store")

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
    """Keep the `count` newest versions (>= 2: the newest two always stay)."""

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
    """Keep every version whose step is a multiple of `steps` (>= 1)."""

    steps: int

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"retain keep_every={self.steps} must be >= 1 or None")

    def keeps(self, manifests: Mapping[int, Manifest]) -> set[int]:
        return {v for v, m in manifests.items() if m.step % self.steps == 0}


@dataclass(frozen=True, slots=True)
class KeepVersions:
    """Keep the named versions (those that exist)."""

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
    """Delete every version no policy keeps, then every array folder no kept manifest
    references, then leftover temp files.

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
            hooks.point(BEFORE_DELETE, version=v, path=manifest_path(v))
            backend.rm(manifest_path(v))
            deleted.append(manifest_path(v))
    referenced = {
        "/".join(meta.path.split("/")[:2])
        for v in keep
        if v in manifests
        for meta in manifests[v].arrays.values()
        if meta.path.startswith(f"{VERSIONS}/")
    }
    newest = have[-1]
    for name in backend.listdir(VERSIONS):
        folder = f"{VERSIONS}/{name}"
        if name == ROOT_META or folder in referenced:
            continue
        parsed = parse_version_folder(name)
        # Folders above the newest manifest may be a write in flight: never touch.
        if parsed is not None and parsed.version > newest:
            continue
        hooks.point(BEFORE_DELETE, version=None if parsed is None else parsed.version, path=folder)
        backend.rm(folder, recursive=True)
        deleted.append(folder)
    for rel in _partials(store):
        backend.rm(rel)
        deleted.append(rel)
    return deleted


def verified_manifests(store: Store, have: list[int], on_damage: OnDamage) -> dict[int, Manifest]:
    """Every manifest of `have` that parses and verifies; a failing one stops retention
    (or, with `OnDamage.DISCARD`, is left out so that it is deleted). Callers that must
    refuse before writing anything (gc takes the lease first) check with it up front.

    Raises:
        CorruptVersionError, FormatVersionError: with `OnDamage.STOP`, a manifest fails
            to verify; the message says nothing was deleted and how to go on.
    """
    manifests: dict[int, Manifest] = {}
    for v in have:
        try:
            manifests[v] = store.manifest(v)
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


def _partials(store: Store) -> Iterator[str]:
    for top in (MANIFESTS, LEASES, SECRET):
        for name in store.backend.listdir(top):
            if is_partial(name):
                yield f"{top}/{name}"
