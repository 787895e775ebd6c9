"""The store root: its zarr.json (format version, attributes), the skeleton written
before it, and telling a store from something else at the same location."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from .backend import Backend
from .canonical_json import load_bounded
from .errors import FormatVersionError, NotAStoreError
from .manifest import FORMAT_VERSION
from .paths import LEASES, MANIFESTS, ROOT_META, SHARED, VERSIONS, is_partial

__all__ = [
    "ATTRIBUTES_KEY",
    "enclosing_store",
    "foreign_entries",
    "initialise",
    "load_root",
    "read_root",
    "refuse_nested",
]

#: Bytes of a root zarr.json read while looking for a store above a path, at most (a
#: store's is ~200 bytes).
_ROOT_META_LIMIT = 1 << 16

#: The key of the root zarr.json's attributes that marks a cocoon-ckpt store.
ATTRIBUTES_KEY = "cocoon_ckpt"

#: The skeleton `initialise` writes before the root zarr.json: folder -> its files.
_SKELETON: dict[str, set[str]] = {
    VERSIONS: {ROOT_META},
    SHARED: {ROOT_META},
    MANIFESTS: set(),
    LEASES: set(),
}
_GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def read_root(backend: Backend) -> bytes | None:
    """The root zarr.json's bytes, or None when there is none."""
    try:
        return backend.read_bytes(ROOT_META)
    except FileNotFoundError:
        return None


def foreign_entries(backend: Backend) -> list[str]:
    """What lies at the location besides an unfinished store skeleton (the folders
    `initialise` creates, and its temp files, left by a creator that crashed or is
    still running)."""
    out: list[str] = []
    for name in backend.listdir(""):
        if name in _SKELETON:
            out.extend(
                f"{name}/{sub}"
                for sub in backend.listdir(name)
                if sub not in _SKELETON[name] and not _is_root_temp(sub)
            )
        elif not _is_root_temp(name):
            out.append(name)
    return out


def describe_foreign(url: str, entries: list[str]) -> str:
    """The refusal message for a location holding `entries` that are not a store's."""
    shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} in all)" if len(entries) > 5 else "")
    if any(e.rsplit("/", 1)[-1] in (".zgroup", ".zarray", ".zattrs") for e in entries):
        kind = "holds a zarr v2 store"
    else:
        kind = "is a non-empty folder"
    return (
        f"{url} {kind}, not a cocoon-ckpt store (it holds {shown}); nothing was written: "
        "point at a cocoon-ckpt store, or at a new or empty folder to create one"
    )


def initialise(backend: Backend, attributes: dict[str, Any], created: str) -> dict[str, Any]:
    """Write an empty store's skeleton, then its root zarr.json (last: its presence says
    the skeleton is complete). Returns the store's attributes: ours, or those of a
    creator that finished first."""
    b = backend
    b.makedirs("", private=True)
    b.chmod_private("")
    attrs = {ATTRIBUTES_KEY: {"format_version": FORMAT_VERSION, "created": created, **attributes}}
    for sub in (VERSIONS, SHARED):
        b.makedirs(sub)
        if not b.exists(f"{sub}/{ROOT_META}"):
            b.write_once(f"{sub}/{ROOT_META}", json.dumps(_GROUP).encode())
    b.makedirs(MANIFESTS)
    b.makedirs(LEASES)
    root = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    try:
        b.create_once(ROOT_META, json.dumps(root, indent=1).encode())
    except FileExistsError:
        return load_root(b, b.read_bytes(ROOT_META))
    return attrs[ATTRIBUTES_KEY]


def load_root(backend: Backend, raw: bytes) -> dict[str, Any]:
    """The store's attributes from its root zarr.json.

    Raises:
        NotAStoreError: a zarr.json without our attributes (a plain zarr group or array).
        FormatVersionError: the store is of a newer format.
    """
    try:
        doc = load_bounded(raw)  # a planted root nested 10,000 deep is not a store
        attrs = doc["attributes"][ATTRIBUTES_KEY]
    except (ValueError, KeyError, TypeError) as exc:
        raise NotAStoreError(
            f"{backend.url} holds a zarr.json that is not a cocoon-ckpt store root "
            f"(a plain zarr group or array: no '{ATTRIBUTES_KEY}' attributes); it is left as "
            "it is: point at a cocoon-ckpt store, or at a new or empty folder"
        ) from exc
    fv = attrs.get("format_version")
    if not isinstance(fv, int) or fv > FORMAT_VERSION:
        raise FormatVersionError(
            f"{backend.url}: store format version {fv!r} is newer than this library "
            f"reads ({FORMAT_VERSION}); upgrade cocoon-ckpt to open it"
        )
    return dict(attrs)


def enclosing_store(path: str, *, include_self: bool = False) -> str | None:
    """The root of the cocoon-ckpt store whose tree holds local path `path`, or None.

    Walks up from `path`, resolved through links, looking in each folder for a root
    zarr.json carrying our attributes; `path` itself counts only with `include_self`.
    Local paths only: an object store's prefixes are not looked at. Nothing is created;
    a zarr.json that is not a regular file is not read (a FIFO would block).

    Args:
        path: a local path (it need not exist).
        include_self: also a store rooted at `path` itself.
    """
    here = os.path.realpath(path)
    if not include_self:
        here = os.path.dirname(here)
    while True:
        if _is_store_root(here):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def _is_store_root(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, ROOT_META), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # none, or unreadable: not a store we can tell of
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        raw = os.read(fd, _ROOT_META_LIMIT)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        doc = load_bounded(raw)
        return isinstance(doc, dict) and ATTRIBUTES_KEY in doc["attributes"]
    except (ValueError, KeyError, TypeError):
        return False


def refuse_nested(backend: Backend) -> None:
    """Refuse a local store root that lies inside another store's tree: the outer
    store's retention and gc delete what its manifests do not name, the inner store
    with it. Object stores are not checked (their prefixes hold no such trees of ours
    that a listing would not show); nothing is written.

    Raises:
        NotAStoreError: naming both stores and the fix.
    """
    if not backend.local:
        return
    outer = enclosing_store(backend.root)
    if outer is not None:
        raise NotAStoreError(
            f"store {backend.url} lies inside the cocoon-ckpt store {outer}, whose gc and "
            "retention delete what its manifests do not name; nothing was written: choose "
            "a store path (--store) outside it"
        )


def _is_root_temp(name: str) -> bool:
    return name.startswith(f"{ROOT_META}.") and is_partial(name)
