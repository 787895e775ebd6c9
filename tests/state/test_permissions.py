"""Owner-only on local disk whatever the umask, and a location that is not a store is
refused before anything is written or chmod'ed."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr

from state import NotAStoreError, Store, StoreError, StoreNotFoundError


@pytest.fixture
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o000, 0o022], indirect=True)
def test_every_file_0600_and_folder_0700_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    root = tmp_path / "runs" / "s.zarr"  # the parent is created too
    store = Store.open(str(root))
    store.put_secret("noise.key", b"k" * 32)
    store.acquire_lease()
    shared = store.put_shared("tok/emb/t/csc/values", np.arange(7, dtype=np.float32))
    for step in (1, 2, 3):
        txn = store.begin(step)
        txn.put_array("model/fc.weight", np.ones((3, 4), dtype=np.float32) * step)
        txn.put_array(f"ring/shard-0000/w-{step:08d}", np.full(5, step, dtype=np.float64))
        txn.put_array("step", np.array(step))
        txn.reference("emb/t/csc/values", shared)
        txn.put_record("sampler", {"seed": 3})
        txn.commit()
    w = store.shard_writer(4, 4, store.lease.generation, 1)  # a rank's folder
    w.put_array("ring/shard-0001/w-00000004", np.zeros(5))
    w.finish()
    store.retain(keep_last=2)
    store.release_lease()
    modes = {}
    for dirpath, _dirnames, filenames in os.walk(tmp_path / "runs"):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
            modes[os.path.relpath(name, tmp_path)] = stat.S_IMODE(os.lstat(name).st_mode)
    assert any("/c." in p for p in modes) and any("leases/" in p for p in modes)
    assert any("shared/tok" in p for p in modes) and any("-r0001" in p for p in modes)
    wrong = {
        p: oct(m)
        for p, m in modes.items()
        if m != (0o700 if os.path.isdir(tmp_path / p) else 0o600)
    }
    assert wrong == {}


def _tree(root: Path) -> dict[str, str]:
    """Every path under and including `root`: type, mode and bytes."""
    out = {}
    for p in sorted([root, *root.rglob("*")]) if root.exists() else []:
        st_ = p.lstat()
        body = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "-"
        out[str(p.relative_to(root.parent))] = f"{st_.st_mode:o}:{body}"
    return out


def _user_folder(p: Path) -> None:
    (p / "notes").mkdir(parents=True)
    (p / "a.txt").write_text("mine")
    (p / "notes" / "b.txt").write_text("also mine")


def _zarr_v2(p: Path) -> None:
    g = zarr.open_group(str(p), mode="w", zarr_format=2)
    g.create_array("x", shape=(4,), dtype="f4")[:] = 1.0


def _zarr_v3(p: Path) -> None:
    g = zarr.open_group(str(p), mode="w", zarr_format=3)
    g.create_array("x", shape=(4,), dtype="f4")[:] = 1.0


def _a_file(p: Path) -> None:
    p.write_bytes(b"not a folder")


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (_user_folder, "is a non-empty folder, not a cocoon-ckpt store (it holds a.txt, notes"),
        (_zarr_v2, "holds a zarr v2 store"),
        (_zarr_v3, "not a cocoon-ckpt store root (a plain zarr group"),
        (_a_file, "is a file, not a cocoon-ckpt store"),
    ],
)
def test_a_location_that_is_not_a_store_is_refused_unchanged(
    tmp_path: Path, make: object, said: str
) -> None:
    target = tmp_path / "x.zarr"
    make(target)  # type: ignore[operator]
    if target.is_dir():
        os.chmod(target, 0o755)
    before = _tree(target)
    for create in (True, False):
        with pytest.raises(StoreNotFoundError) as err:
            Store.open(str(target), create=create)
        # without create, a folder with no zarr.json is simply no store
        if create or make in (_zarr_v3, _a_file):
            assert isinstance(err.value, NotAStoreError) and said in str(err.value)
        assert isinstance(err.value, StoreError) and str(target) in str(err.value)
        assert _tree(target) == before


def test_an_empty_folder_or_an_unfinished_skeleton_becomes_a_store(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o755)
    Store.open(str(empty))
    assert stat.S_IMODE(os.stat(empty).st_mode) == 0o700
    assert json.loads((empty / "zarr.json").read_text())["attributes"]["cocoon_ckpt"]
    # a creator that died before the root zarr.json: its skeleton is taken over
    (empty / "zarr.json").unlink()
    (empty / "versions" / "zarr.json.0123abcd.partial").write_bytes(b"{")
    store = Store.open(str(empty))
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("a", np.zeros(2))
    txn.commit()
    assert Store.open(str(empty), create=False).latest() is not None
