"""Local disk's listings (os.scandir) give what fsspec's LocalFileSystem gives."""

from __future__ import annotations

import os
import tempfile

import hypothesis.strategies as st
from hypothesis import given, settings

from state.backend import Backend
from state.local_backend import LocalBackend

_NAMES = st.sampled_from(["a", "b", "c.json", "zarr.json", "0", "d e"])
_PATHS = st.lists(_NAMES, min_size=1, max_size=4).map("/".join)
_ENTRY = st.tuples(st.sampled_from(["file", "dir", "link-file", "link-dir", "broken"]), _PATHS)


def _build(root: str, entries: list[tuple[str, str]]) -> None:
    """Make what it can of `entries` under `root` (a path whose parent is a file or
    that exists already is skipped)."""
    for kind, rel in entries:
        path = os.path.join(root, rel)
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
            if os.path.lexists(path):
                continue
            if kind == "file":
                with open(path, "wb") as f:
                    f.write(b"x" * len(rel))
            elif kind == "dir":
                os.mkdir(path)
            elif kind == "link-file":
                target = os.path.join(root, "target-file")
                if not os.path.exists(target):
                    with open(target, "wb") as f:
                        f.write(b"12345")
                os.symlink(target, path)
            elif kind == "link-dir":
                target = os.path.join(root, "target-dir")
                os.makedirs(target, exist_ok=True)
                with open(os.path.join(target, "inside"), "wb") as f:
                    f.write(b"abc")
                os.symlink(target, path)
            else:
                os.symlink(os.path.join(root, "missing"), path)
        except (FileExistsError, FileNotFoundError, NotADirectoryError):
            continue  # under a file or a broken link


def _queries(root: str) -> list[str]:
    """ "", and every path under `root` (files, folders, links), and one missing."""
    out = ["", "missing/below"]
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(_ENTRY, max_size=14))
def test_listings_equal_fsspecs(entries: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "store")
        os.mkdir(root)
        _build(root, entries)
        backend = LocalBackend(root)
        for rel in _queries(root):
            assert backend.find(rel) == Backend.find(backend, rel), rel
            assert backend.sizes(rel) == Backend.sizes(backend, rel), rel
            if os.path.isdir(backend.path(rel)) or not os.path.lexists(backend.path(rel)):
                assert backend.listdir(rel) == Backend.listdir(backend, rel), rel


def test_a_store_root_that_is_a_link_is_listed_through_it(tmp_path: str) -> None:
    real = os.path.join(tmp_path, "real")
    os.makedirs(os.path.join(real, "versions", "v1"))
    with open(os.path.join(real, "versions", "v1", "zarr.json"), "wb") as f:
        f.write(b"{}")
    link = os.path.join(tmp_path, "link")
    os.symlink(real, link)
    backend = LocalBackend(link)
    assert backend.find("") == ["versions/v1/zarr.json"] == Backend.find(backend, "")
    assert backend.sizes("versions") == {"versions/v1/zarr.json": 2}
