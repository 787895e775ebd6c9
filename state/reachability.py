"""Which stored files a set of manifests reaches, and what is left over.

An array is reachable while a manifest names its path; its files are every file under
that path. A zarr group's `zarr.json` above a reachable array is scaffolding its
readers need. Under `versions/`, everything else in a folder no newer than the newest
manifest is unreachable: retention deletes it, array by array (a folder left with no
reachable array goes whole). Folders above the newest manifest may be a write in
flight and are never classed unreachable. `shared/` arrays are written once for a
job's lifetime, before the versions that reference them commit, so an unreferenced one
is counted apart and never deleted.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .canonical_json import load_bounded
from .errors import CorruptVersionError, FormatVersionError, StoreError
from .manifest import Manifest
from .paths import (
    ROOT_META,
    SHARED,
    VERSIONS,
    manifest_path,
    parse_version_folder,
    unsafe_path_reason,
)

if TYPE_CHECKING:
    from .store import Store

__all__ = ["Reach", "Space", "deletion_units", "referenced_arrays", "space"]


class Reach(enum.Enum):
    """What one stored file is to the manifests."""

    REFERENCED = "referenced"
    """Part of an array a manifest names."""
    SCAFFOLDING = "scaffolding"
    """Group metadata above a referenced array, or a top folder's own."""
    UNREACHABLE = "unreachable"
    """Under versions/, no newer than the newest manifest, needed by none: retention
    deletes it."""
    IN_FLIGHT = "in_flight"
    """In a version folder above the newest manifest: possibly a write in progress."""
    UNREFERENCED_SHARED = "unreferenced_shared"
    """Under shared/ and named by no manifest (kept: shared arrays live as long as the
    job)."""
    METADATA = "metadata"
    """Outside versions/ and shared/: manifests, leases, secrets, the root."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Space:
    """Bytes of a store by what the manifests reach (each file counted once).

    Attributes:
        total: Every file of the store.
        data: Files under versions/ and shared/ (arrays and their group metadata).
        referenced: Files of the arrays some manifest names.
        scaffolding: Group metadata the referenced arrays' readers need.
        unreachable: What retention deletes: files under versions/ no manifest needs.
        in_flight: Files of version folders above the newest manifest (a write in progress, or one
            that crashed before its commit; the next commit at that number clears it).
        unreferenced_shared: Files of shared/ arrays no manifest names.
        unreadable: Versions whose manifest fails to verify. The arrays table of such a manifest is
            still read where it parses (those arrays count as referenced); retention deletes nothing
            while one exists, unless told to discard them.
    """

    total: int
    data: int
    referenced: int
    scaffolding: int
    unreachable: int
    in_flight: int
    unreferenced_shared: int
    unreadable: tuple[int, ...] = ()

    @property
    def data_ratio(self) -> float:
        """`data / referenced` (1.0 when nothing is referenced and nothing is stored)."""
        if self.referenced == 0:
            return 1.0 if self.data == 0 else float("inf")
        return self.data / self.referenced


def referenced_arrays(manifests: Iterable[Manifest]) -> set[str]:
    """The store-relative path of every array the manifests name."""
    return {meta.path for m in manifests for meta in m.arrays.values()}


def _ancestors(path: str) -> list[str]:
    """`a`, `a/b` for `a/b/c`: every folder above a path, top first."""
    parts = path.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _under(path: str, arrays: set[str]) -> bool:
    """Whether `path` is one of `arrays` or lies inside one."""
    parts = path.split("/")
    return any("/".join(parts[:i]) in arrays for i in range(1, len(parts) + 1))


class _Classifier:
    """Classes the files of a store against the arrays the manifests name."""

    def __init__(self, referenced: set[str], newest: int | None) -> None:
        self.referenced = referenced
        self.newest = newest
        #: Every folder above a referenced array: their zarr.json is scaffolding.
        self.groups = {a for path in referenced for a in _ancestors(path)}

    def reach(self, rel: str) -> Reach:
        top, _, rest = rel.partition("/")
        if top not in (VERSIONS, SHARED) or not rest:
            return Reach.METADATA
        if rest == ROOT_META:
            return Reach.SCAFFOLDING
        if _under(rel, self.referenced):
            return Reach.REFERENCED
        parent, _, leaf = rel.rpartition("/")
        if leaf == ROOT_META and parent in self.groups:
            return Reach.SCAFFOLDING
        if top == SHARED:
            return Reach.UNREFERENCED_SHARED
        folder = parse_version_folder(rest.split("/", 1)[0])
        if folder is not None and self.newest is not None and folder.version > self.newest:
            return Reach.IN_FLIGHT
        if folder is not None and self.newest is None:
            return Reach.IN_FLIGHT  # no manifest yet: the first version may be in flight
        return Reach.UNREACHABLE


def deletion_units(
    folders: Iterable[str], files: Iterable[str], referenced: set[str], newest: int
) -> list[str]:
    """What retention deletes under versions/, as few paths (each removed recursively)
    as cover every unreachable file and nothing else.

    A folder holding no referenced array goes whole, scaffolding and all; inside one
    that holds some, each topmost sub-folder with nothing needed below it goes (an
    unreferenced array, or a group of them), and a stray file beside needed ones goes
    alone.

    Args:
        folders: names directly under versions/ (empty folders included: a deletion
            interrupted on local disk can leave one).
        files: every file under versions/, store-relative.
        referenced: the arrays the kept manifests name.
        newest: the newest version with a manifest; folders above it are never touched.

    Returns:
        Store-relative paths, sorted.
    """
    classify = _Classifier(referenced, newest)
    needed: set[str] = set()  # every folder with something needed below it
    garbage: list[str] = []
    for rel in files:
        kind = classify.reach(rel)
        if kind is Reach.UNREACHABLE:
            garbage.append(rel)
        elif kind is not Reach.METADATA:
            needed.update(_ancestors(rel))
    units: set[str] = set()
    for name in folders:
        folder = f"{VERSIONS}/{name}"
        if name == ROOT_META or folder in needed:
            continue
        parsed = parse_version_folder(name)
        if parsed is None or parsed.version <= newest:
            units.add(folder)
    for rel in garbage:
        top = next((a for a in _ancestors(rel)[1:] if a not in needed), rel)
        units.add(top)
    # A unit inside another unit goes with it.
    return sorted(u for u in units if not any(a in units for a in _ancestors(u)))


def space(store: Store) -> Space:
    """Bytes of `store` by what its manifests reach (one listing with sizes, and every
    manifest read)."""
    have = store.versions()
    referenced: set[str] = set()
    unreadable: list[int] = []
    for v in have:
        try:
            referenced |= referenced_arrays([store.manifest(v)])
        except (CorruptVersionError, FormatVersionError):
            unreadable.append(v)
            referenced |= _paths_of_damaged(store, v)
    return _tally(
        store.backend.sizes(""),
        _Classifier(referenced, have[-1] if have else None),
        tuple(unreadable),
    )


def _tally(sizes: Mapping[str, int], classify: _Classifier, unreadable: tuple[int, ...]) -> Space:
    by = dict.fromkeys(Reach, 0)
    for rel, size in sizes.items():
        by[classify.reach(rel)] += size
    total = sum(by.values())
    return Space(
        total=total,
        data=total - by[Reach.METADATA],
        referenced=by[Reach.REFERENCED],
        scaffolding=by[Reach.SCAFFOLDING],
        unreachable=by[Reach.UNREACHABLE],
        in_flight=by[Reach.IN_FLIGHT],
        unreferenced_shared=by[Reach.UNREFERENCED_SHARED],
        unreadable=unreadable,
    )


def _paths_of_damaged(store: Store, version: int) -> set[str]:
    """The confined array paths a manifest that fails to verify still names, where its
    JSON parses within bounds: what it may need is not called unreachable."""
    try:
        raw = load_bounded(store.backend.read_bytes(manifest_path(version)))
        table = raw["arrays"]
        paths = {str(meta["path"]) for meta in table.values()}
    except (OSError, StoreError, ValueError, KeyError, TypeError, AttributeError):
        return set()
    return {p for p in paths if unsafe_path_reason(p) is None}
