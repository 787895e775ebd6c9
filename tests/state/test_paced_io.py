"""Large files are written in paced pieces and chunks read in cache-sized pieces; neither
changes a stored bit nor weakens a check."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state import Store, arrays, file_writes
from state.checksum import array_checksum, crc32c_combine
from state.open import open_backend


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "lease" not in p.name
    }


def _version(url: str) -> None:
    store = Store.open(url)
    store.acquire_lease()
    txn = store.begin(5)
    txn.put_array(
        "ring/shard-0000/w-00000002", np.arange(3 * 1001, dtype=np.float32).reshape(3, 1001)
    )
    txn.put_array("model/fc.weight", np.linspace(-1, 1, 777, dtype=np.float64))
    txn.put_array("model/fc.bias", np.ones(3, dtype=np.float32))
    txn.commit()
    store.release_lease()


@pytest.mark.parametrize("pace", [600, 1000])
def test_a_paced_version_holds_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pace: int
) -> None:
    monkeypatch.setattr(arrays, "CHUNK_BYTES", 4096)  # ragged, padded edge chunks
    monkeypatch.setattr(file_writes, "PACE_BYTES", 0)
    _version(str(tmp_path / "whole.zarr"))
    monkeypatch.setattr(file_writes, "PACE_BYTES", pace)
    monkeypatch.setattr(file_writes, "_PACE_WINDOW", 2)  # waits and drops start early
    _version(str(tmp_path / "paced.zarr"))
    whole, paced = _files(tmp_path / "whole.zarr"), _files(tmp_path / "paced.zarr")
    # manifests carry the time and the lease: compare every other file bit for bit
    chunks = {k for k in whole if "/c." in k}
    assert len(chunks) > 3 and chunks == {k for k in paced if "/c." in k}
    assert all(whole[k] == paced[k] for k in chunks)
    assert max(len(whole[k]) for k in chunks) > 2 * 2 * pace  # some waited and dropped
    v = Store.open(str(tmp_path / "paced.zarr"), create=False).latest()
    assert v is not None
    np.testing.assert_array_equal(v.array("model/fc.weight"), np.linspace(-1, 1, 777))


@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=4),
    pace=st.integers(1, 3000),
    window=st.integers(1, 3),
)
@settings(max_examples=40, deadline=None)
def test_paced_write_writes_every_part_in_order(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], pace: int, window: int
) -> None:
    parts = [bytes((i * 7 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    path = tmp_path_factory.mktemp("p") / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    old = file_writes._PACE_WINDOW
    file_writes._PACE_WINDOW = window
    try:
        file_writes._write_paced(fd, [memoryview(p) for p in parts], pace)
        os.fsync(fd)
    finally:
        file_writes._PACE_WINDOW = old
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)


def test_staged_files_are_still_fsynced_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pacing starts writebacks early; the fsync of every file before the manifest is
    still the commit's."""
    monkeypatch.setattr(file_writes, "PACE_BYTES", 1024)
    synced: set[str] = set()
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.add(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(file_writes.os, "fsync", fsync)
    backend = open_backend(str(tmp_path))
    arrays.ensure_groups(backend, "g", "a", set())
    arrays.write_array(backend, "g", "a", np.arange(5000, dtype=np.float64))
    backend.fsync_tree("g")
    written = {str(p) for p in tmp_path.rglob("*")}
    assert any(p.stat().st_size > 4 * 1024 for p in tmp_path.rglob("c.*"))  # paced
    assert written <= synced  # every file and folder


@given(
    rows=st.integers(1, 40),
    width=st.integers(1, 50),
    piece=st.integers(1, 700),
    dtype=st.sampled_from([np.float32, np.float64, np.int8, np.uint16]),
)
@settings(max_examples=40, deadline=None)
def test_reads_in_pieces_check_every_crc(
    tmp_path_factory: pytest.TempPathFactory, rows: int, width: int, piece: int, dtype: type
) -> None:
    """Any piece size, chunk size and padded edge: the bytes and the array checksum are
    the written ones, and a flipped byte anywhere in any chunk is caught."""
    root = tmp_path_factory.mktemp("r")
    backend = open_backend(str(root))
    arr = (np.arange(rows * width) % 97).astype(dtype).reshape(rows, width)
    old = arrays.CHUNK_BYTES, arrays._PIECE
    arrays.CHUNK_BYTES = 3 * width * arr.dtype.itemsize + 1  # 3 rows a chunk, edge padded
    try:
        arrays.ensure_groups(backend, "g", "a", set())
        checksum, chunks = arrays.write_array(backend, "g", "a", arr)
        arrays._PIECE = piece
        layout = (arr.shape, str(arr.dtype), chunks)
        got, crc = arrays.read_array(backend, "g", "a", layout, arrays.CHUNK_SEPARATOR)
        assert got.tobytes() == arr.tobytes() and crc == checksum == array_checksum(arr)
        for chunk in sorted((root / "g" / "a").glob("c.*")):
            data = chunk.read_bytes()
            for at in {0, len(data) // 2, len(data) - 5, len(data) - 1}:
                bad = bytearray(data)
                bad[at] ^= 0x10
                chunk.write_bytes(bytes(bad))
                with pytest.raises(ValueError, match="crc32c"):
                    arrays.read_array(backend, "g", "a", layout, arrays.CHUNK_SEPARATOR)
            chunk.write_bytes(data)
    finally:
        arrays.CHUNK_BYTES, arrays._PIECE = old


@pytest.mark.parametrize("change", ["short", "long"])
def test_a_chunk_of_another_length_is_torn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    monkeypatch.setattr(arrays, "CHUNK_BYTES", 400)
    monkeypatch.setattr(arrays, "_PIECE", 64)
    backend = open_backend(str(tmp_path))
    arrays.ensure_groups(backend, "g", "a", set())
    arr = np.arange(300, dtype=np.float32)
    arrays.write_array(backend, "g", "a", arr)
    chunk = tmp_path / "g" / "a" / "c.1"
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-7] if change == "short" else data + b"\0")
    with pytest.raises(ValueError, match="torn"):
        arrays.read_array(backend, "g", "a")


@given(a=st.binary(max_size=300), b=st.binary(max_size=300), pad=st.integers(0, 70_000))
@settings(max_examples=60, deadline=None)
def test_crc32c_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes, pad: int) -> None:
    b = b + bytes(pad)  # lengths past the first few powers of two
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)
