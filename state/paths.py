"""Every on-disk name of a store, built and parsed in one place.

```
zarr.json                               root group (its presence: the store exists)
versions/<v:08d>-g<gen>[-r<k:04d>]/...  arrays new in version v (rank k's shard)
shared/<name>                           job-lifetime arrays, written once
manifests/<v:08d>.json                  commit record of version v
leases/<gen:08d>.json                   writer lease of generation gen
leases/<gen:08d>.released|.heartbeat    its release marker and its renewal
secret/<name>                           owner-only secrets (the noise key)
*.<hex>.partial                         a temp file of a write that did not finish
```
Numbers are zero padded so that a listing sorts in order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "LEASES",
    "MANIFESTS",
    "ROOT_META",
    "SECRET",
    "SHARED",
    "VERSIONS",
    "VersionFolder",
    "array_group",
    "check_name",
    "is_partial",
    "lease_heartbeat_path",
    "lease_path",
    "lease_released_path",
    "manifest_path",
    "parse_lease_name",
    "parse_manifest_name",
    "parse_version_folder",
    "partial_path",
    "secret_path",
    "shared_path",
    "unsafe_path_reason",
    "version_folder",
    "version_of_path",
    "version_prefix",
]

ROOT_META = "zarr.json"
VERSIONS = "versions"
SHARED = "shared"
MANIFESTS = "manifests"
LEASES = "leases"
SECRET = "secret"
_PARTIAL = ".partial"

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")
_VERSION_FOLDER = re.compile(r"^(?P<v>[0-9]{8})-g(?P<g>[0-9]{1,18})(?:-r(?P<r>[0-9]{1,18}))?$")
_MANIFEST = re.compile(r"^(?P<v>[0-9]{8})\.json$")
# At most 18 digits: a generation fits an int64 (a planted 5,000-digit name would fail
# every int() of it); a longer name is not a lease record.
_LEASE = re.compile(r"^(?P<g>[0-9]{1,18})\.json$")
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")


def check_name(name: str) -> None:
    """Refuse a logical array or secret name that is not `/`-separated parts of letters,
    digits, `_`, `.`, `-` (no `..`).

    Raises:
        ValueError: naming the name and the rule.
    """
    if not _NAME.match(name) or ".." in name.split("/"):
        raise ValueError(
            f"array name {name!r} must be '/'-separated parts of letters, digits, '_', '.', '-'"
        )


# versions/ -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VersionFolder:
    """A parsed `versions/` folder name."""

    version: int
    generation: int
    rank: int | None


def version_folder(version: int, generation: int, rank: int | None = None) -> str:
    """`versions/<v:08d>-g<gen>`, or with `rank` a shard's `...-r<rank:04d>`."""
    base = f"{VERSIONS}/{version:08d}-g{generation}"
    return base if rank is None else f"{base}-r{rank:04d}"


def version_prefix(version: int) -> str:
    """The prefix every path of an array written by version `version` starts with
    (its own folder and its shards' folders)."""
    return f"{VERSIONS}/{version:08d}-g"


def parse_version_folder(name: str) -> VersionFolder | None:
    """Parse a folder name directly under versions/ (`00000012-g3`, `00000012-g3-r0001`);
    None for anything else (zarr.json, a foreign folder)."""
    m = _VERSION_FOLDER.match(name)
    if m is None:
        return None
    rank = m.group("r")
    return VersionFolder(int(m.group("v")), int(m.group("g")), None if rank is None else int(rank))


def version_of_path(path: str) -> int | None:
    """The version whose folder holds store-relative array path `path`; None for a
    path outside versions/ (shared/) or not in a version folder."""
    parts = path.split("/")
    if len(parts) < 2 or parts[0] != VERSIONS:
        return None
    folder = parse_version_folder(parts[1])
    return None if folder is None else folder.version


def array_group(path: str) -> tuple[str, str]:
    """Split an array path into the zarr group it was written into (`versions/<folder>`
    or `shared`) and its name inside that group."""
    top = path.split("/")
    base = "/".join(top[:2]) if top[0] == VERSIONS else top[0]
    return base, path[len(base) + 1 :]


def shared_path(name: str) -> str:
    return f"{SHARED}/{name}"


# manifests/ ----------------------------------------------------------------------
def manifest_path(version: int) -> str:
    """Store-relative path of version `version`'s manifest (zero padded: lists in order)."""
    return f"{MANIFESTS}/{version:08d}.json"


def parse_manifest_name(name: str) -> int | None:
    """The version of a name directly under manifests/, or None (temp files, others)."""
    m = _MANIFEST.match(name)
    return None if m is None else int(m.group("v"))


# leases/ -------------------------------------------------------------------------
def lease_path(generation: int) -> str:
    return f"{LEASES}/{generation:08d}.json"


def lease_released_path(generation: int) -> str:
    return f"{LEASES}/{generation:08d}.released"


def lease_heartbeat_path(generation: int) -> str:
    return f"{LEASES}/{generation:08d}.heartbeat"


def parse_lease_name(name: str) -> int | None:
    """The generation of a lease record's name under leases/, or None."""
    m = _LEASE.match(name)
    return None if m is None else int(m.group("g"))


# secret/ and temp files ------------------------------------------------------------
def secret_path(name: str) -> str:
    return f"{SECRET}/{name}"


def partial_path(final: str, token: str) -> str:
    """The temp name a write of `final` goes through before it is moved or linked."""
    return f"{final}.{token}{_PARTIAL}"


def is_partial(name: str) -> bool:
    """Whether `name` is the temp file of an unfinished write."""
    return name.endswith(_PARTIAL)


# confinement -----------------------------------------------------------------------
def unsafe_path_reason(path: str) -> str | None:
    """Why an array path from a manifest is not confined to the store, or None if it is.

    A confined path is `versions/<v:08d>-g<gen>[-r<k>]/<name>` or `shared/<name>`, with
    every component non-empty, not `.` or `..`, of letters, digits, `_`, `.`, `-`.
    """
    if not path:
        return "is empty"
    if path.startswith("/") or _URL_SCHEME.match(path):
        return "is absolute"
    if "\\" in path:
        return "holds a backslash"
    parts = path.split("/")
    if any(p == "" for p in parts):
        return "has an empty component"
    if any(p in (".", "..") for p in parts):
        return "has a '.' or '..' component"
    if not all(_PART.match(p) for p in parts):
        return "has a component with characters other than letters, digits, '_', '.', '-'"
    if parts[0] == VERSIONS:
        if len(parts) < 3 or not _VERSION_FOLDER.match(parts[1]):
            return "is not inside a version folder versions/<v>-g<gen>[-r<rank>]/"
        return None
    if parts[0] == SHARED:
        return None if len(parts) >= 2 else "names no array under shared/"
    return "lies outside versions/ and shared/"
