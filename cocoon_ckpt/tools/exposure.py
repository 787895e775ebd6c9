"""Who besides the owner can read a local store, following links (I6).

A path is exposed to group (others) when it has their read bit and every folder on
the way to it has their search bit. Inside the store the way starts at the store root.
A link that leaves the store is followed: what it points to can be read by its own
path, without passing the store root, so its way starts at `/`.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field

__all__ = ["CLASSES", "Exposure", "walk_exposure"]

#: (read bit, search bit) of each class of reader besides the owner.
CLASSES = {"group": (stat.S_IRGRP, stat.S_IXGRP), "others": (stat.S_IROTH, stat.S_IXOTH)}


@dataclass(slots=True)
class Exposure:
    """What the walk found; paths are relative to the store root, as reached."""

    checked: int = 0
    exposed: dict[str, list[str]] = field(default_factory=lambda: {c: [] for c in CLASSES})
    links_out: list[tuple[str, str]] = field(default_factory=list)
    """(link, where it points) for every link that leaves the store."""
    broken: list[str] = field(default_factory=list)
    """Links that point nowhere."""


def _way_from_slash(folder: str) -> dict[str, bool]:
    """Whether each class can search every folder from / down to `folder` (real path)."""
    reach = dict.fromkeys(CLASSES, True)
    parts = folder.strip(os.sep).split(os.sep) if folder != os.sep else []
    path = os.sep
    for i in range(len(parts) + 1):
        if i:
            path = os.path.join(path, parts[i - 1])
        mode = os.stat(path).st_mode
        for c, (_, x) in CLASSES.items():
            reach[c] = reach[c] and bool(mode & x)
    return reach


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def walk_exposure(root: str) -> Exposure:
    """Walk the local store at `root`, following links (each real folder once).

    Args:
        root: the store's root folder.
    """
    out = Exposure()
    real_root = os.path.realpath(root)
    mode = os.stat(real_root).st_mode
    start = {c: bool(mode & x) for c, (_, x) in CLASSES.items()}
    out.checked += 1
    for c, (r, _) in CLASSES.items():
        if mode & r:  # the root's listing names every version and the key file
            out.exposed[c].append(".")
    seen = {real_root}
    stack: list[tuple[str, str, dict[str, bool]]] = [("", real_root, start)]
    while stack:
        rel, real, reach = stack.pop()
        with os.scandir(real) as entries:
            listed = sorted(entries, key=lambda e: e.name)
        for entry in listed:
            shown = os.path.join(rel, entry.name)
            here = reach
            target = entry.path
            if entry.is_symlink():
                target = os.path.realpath(entry.path)
                if not os.path.exists(target):
                    out.broken.append(shown)
                    continue
                if _inside(target, real_root):
                    continue  # the walk reaches it at its own place in the store
                out.links_out.append((shown, target))
                here = _way_from_slash(os.path.dirname(target))
            st = os.stat(target)
            out.checked += 1
            for c, (r, _) in CLASSES.items():
                if here[c] and st.st_mode & r:
                    out.exposed[c].append(shown)
            if stat.S_ISDIR(st.st_mode) and target not in seen:
                seen.add(target)
                below = {c: here[c] and bool(st.st_mode & x) for c, (_, x) in CLASSES.items()}
                stack.append((shown, target, below))
    return out
