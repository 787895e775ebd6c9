"""Staged writes: a version's files are fsynced in the background as they are written,
yet every file and folder is durable before the manifest exists, a failed fsync fails
the commit, and the bytes are exactly zarr's own."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec

from state import Store, hooks, local_backend
from state import arrays as arrays_module
from state.arrays import ensure_groups, write_array
from state.checksum import array_checksum
from state.open import open_backend


@pytest.fixture(autouse=True)
def no_hooks_left() -> Iterator[None]:
    yield
    hooks.disarm_all()


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Every path fsynced so far (recorded as the fsync returns)."""
    done: set[str] = set()
    real = os.fsync

    def recording(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        real(fd)
        done.add(path)

    monkeypatch.setattr(os, "fsync", recording)
    return done


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_every_file_and_folder_is_fsynced_before_the_manifest(
    tmp_path: Path, fsynced: set[str]
) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("ring/shard-0000/w-00000001-00000003", np.ones((3, 1000), np.float32))
    txn.put_array("model/fc.weight", np.arange(12.0).reshape(3, 4))
    txn.put_array("rng/numpy", np.arange(7, dtype=np.uint32))
    folder = os.path.realpath(store.backend.path(txn.folder))
    seen: list[set[str]] = []

    def snapshot(name: str, ctx: Mapping[str, Any]) -> None:
        seen.append(set(fsynced))

    hooks.arm("checkpoint.before_manifest", snapshot)
    txn.commit()
    on_disk = {folder} | {
        os.path.join(d, n) for d, subdirs, files in os.walk(folder) for n in subdirs + files
    }
    assert len(on_disk) > 10 and on_disk <= seen[0]
    parents = {os.path.dirname(folder), os.path.dirname(os.path.dirname(folder))}
    assert parents <= seen[0]


def test_a_failed_background_fsync_fails_the_commit_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = local_backend._fsync_close

    def failing(fd: int, slots: threading.BoundedSemaphore) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/c.0.0"):
            os.close(fd)
            slots.release()
            raise OSError(5, "Input/output error")
        real(fd, slots)

    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    monkeypatch.setattr(local_backend, "_fsync_close", failing)
    txn = store.begin(1)
    txn.put_array("model/fc.weight", np.ones((3, 4)))
    with pytest.raises(OSError, match="Input/output"):
        txn.commit()
    # Linux may report a second fsync of the same file clean: it is not asked again
    with pytest.raises(OSError, match="Input/output"):
        txn.commit()
    assert store.versions() == []


def test_an_array_rewritten_after_a_failed_try_is_synced_anew(tmp_path: Path) -> None:
    backend = open_backend(str(tmp_path))
    ensure_groups(backend, "g", "a", set())
    write_array(backend, "g", "a", np.zeros(5))
    backend.rm("g/a", recursive=True)
    write_array(backend, "g", "a", np.ones(5))
    backend.fsync_tree("g")
    got, _ = arrays_module.read_array(backend, "g", "a")
    np.testing.assert_array_equal(got, np.ones(5))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((), np.float64), ((0,), np.float32), ((100,), np.float64), ((7, 5), np.int8),
     ((33, 3, 2), np.float32), ((4,), np.bool_), ((9, 2), np.complex64)],
)  # fmt: skip
def test_chunks_are_byte_for_byte_what_zarr_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], dtype: type
) -> None:
    monkeypatch.setattr(arrays_module, "CHUNK_BYTES", 64)  # several chunks, a padded edge
    arr: np.ndarray = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    backend = open_backend(str(tmp_path / "ours"))
    ensure_groups(backend, "g", "a", set())
    checksum, chunks = write_array(backend, "g", "a", arr)
    backend.fsync_tree("g")
    assert checksum == array_checksum(arr)
    zarr.create_array(
        zarr.storage.LocalStore(str(tmp_path / "zarr" / "g")),
        name="a",
        data=arr,
        chunks=chunks,
        filters=None,
        serializer=BytesCodec(endian="little" if arr.dtype.itemsize > 1 else None),
        compressors=[Crc32cCodec()],
        fill_value=np.zeros((), arr.dtype)[()],
        chunk_key_encoding={"name": "default", "separator": arrays_module.CHUNK_SEPARATOR},
        config={"write_empty_chunks": True},
    )
    ours = _files(tmp_path / "ours" / "g" / "a")
    theirs = _files(tmp_path / "zarr" / "g" / "a")
    assert sorted(ours) == sorted(theirs)
    for rel, data in ours.items():
        if rel != "zarr.json":
            assert data == theirs[rel], rel


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_files_waiting_for_their_fsync_are_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local_backend, "_STAGED_OPEN", 2)
    real = local_backend._fsync_close

    def slow(fd: int, slots: threading.BoundedSemaphore) -> None:
        time.sleep(0.01)  # the writer outruns the disk
        real(fd, slots)

    monkeypatch.setattr(local_backend, "_fsync_close", slow)
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    txn = store.begin(1)
    folder = store.backend.path(txn.folder)
    most = 0
    for k in range(12):
        txn.put_array(f"model/p{k}", np.full(3, float(k)))
        fds = os.listdir("/proc/self/fd")
        mine = [fd for fd in fds if _target(fd).startswith(folder)]
        most = max(most, len(mine))
    txn.commit()
    assert 1 <= most <= 2
    version = store.latest()
    assert version is not None
    np.testing.assert_array_equal(version.array("model/p11"), np.full(3, 11.0))


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""
