"""A version's restore reads each array it keeps or holds for one read into an array
allocated on the thread that asked (`Version.verify`), not on its read pool: glibc
serves a pool thread's large allocation from a fresh mapping, so every page of every
restore faulted in again, even where the process had freed and kept that much memory.
The bytes are checked as before: every chunk's crc32c and every array's checksum, a
damaged or torn chunk refused in either path, and a dtype that is not a zarr v3 core
type refused before any byte is read into it (an `object` array would be pointers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import state.version
from state import CorruptVersionError, Store, restamp
from state.arrays import chunk_key, read_array
from state.paths import array_group, manifest_path

KiB = 1 << 10


def _arrays() -> dict[str, np.ndarray]:
    """Arrays of several chunks and dtypes (`CHUNK_BYTES` is patched to 64 KiB)."""
    rng = np.random.default_rng(7)
    return {
        "model/w": rng.standard_normal((300, 100)).astype(np.float32),  # 117 KiB, 2 chunks
        "model/b": np.arange(100, dtype=np.int64),
        "ring/a": rng.standard_normal(40 * KiB).astype(np.float32),  # 160 KiB, 3 chunks
        "ring/b": rng.standard_normal(40 * KiB).astype(np.float32),
        "flags": np.array([True, False, True]),
        "scalar": np.array(3.5),
    }


def _store(root: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    monkeypatch.setattr("state.arrays.CHUNK_BYTES", 64 * KiB)
    store = Store.open(str(root))
    store.acquire_lease()
    txn = store.begin(1)
    for name, a in _arrays().items():
        txn.put_array(name, a)
    txn.commit()
    return store


def _chunk(store: Store, name: str, index: int) -> Path:
    meta = store.manifest(1).arrays[name]
    return Path(store.backend.path(f"{meta.path}/{chunk_key(index, len(meta.shape), '.')}"))


@pytest.mark.parametrize("keep", [1 << 30, 200 * KiB], ids=["kept", "past KEEP_BYTES"])
def test_the_restore_reads_the_arrays_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int
) -> None:
    """Kept, or past `KEEP_BYTES` held for one read: every array equals the one written,
    in shape, dtype and bits."""
    _store(tmp_path / "s", monkeypatch)
    monkeypatch.setattr(state.version, "KEEP_BYTES", keep)
    version = Store.open(str(tmp_path / "s"), create=False).latest(stream=lambda _n: False)
    assert version is not None
    if keep < 1 << 30:  # the three paths: kept, held for one read, streamed
        assert "model/w" in version._cache and set(version._lent) == {"ring/a"}
        assert "ring/b" not in version._cache
    for name, want in _arrays().items():
        got = version.array(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("keep", [1 << 30, 200 * KiB], ids=["kept", "past KEEP_BYTES"])
@pytest.mark.parametrize("name", ["model/w", "ring/a", "ring/b"])
@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "trailer"])
def test_a_damaged_chunk_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: int, name: str, damage: str
) -> None:
    """A byte flipped in the second chunk of an array, the chunk cut short, or its crc
    trailer changed: the version is refused, naming the array. Past `KEEP_BYTES` (200
    KiB) `model/w` is kept, `ring/a` held for one read and `ring/b` checked by a
    streamed pass: each path refuses it."""
    store = _store(tmp_path / "s", monkeypatch)
    path = _chunk(store, name, 1)
    raw = bytearray(path.read_bytes())
    if damage == "flipped byte":
        raw[len(raw) // 2] ^= 0x10
    elif damage == "truncated":
        raw = raw[: len(raw) - 100]
    else:
        raw[-1] ^= 0x01
    os.chmod(path, 0o600)
    path.write_bytes(bytes(raw))
    monkeypatch.setattr(state.version, "KEEP_BYTES", keep)
    with pytest.raises(CorruptVersionError, match=name):
        Store.open(str(tmp_path / "s"), create=False).latest(stream=lambda _n: False)


def test_read_array_reads_into_the_array_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`out` is filled and returned, with the checksum a fresh read gives; one of
    another shape or dtype, or without the layout it must match, is refused before a
    byte is read."""
    store = _store(tmp_path / "s", monkeypatch)
    meta = store.manifest(1).arrays["model/w"]
    group, sub = array_group(meta.path)
    layout = (meta.shape, meta.dtype, meta.chunks)
    assert layout[2] is not None
    out = np.full(meta.shape, np.nan, dtype=np.float32)
    got, checksum = read_array(store.backend, group, sub, layout, ".", out)  # type: ignore[arg-type]
    assert got is out and checksum == meta.checksum
    assert out.tobytes() == _arrays()["model/w"].tobytes()
    for wrong in (np.empty((100, 300), np.float32), np.empty(meta.shape, np.float64)):
        with pytest.raises(ValueError, match="out must be"):
            read_array(store.backend, group, sub, layout, ".", wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be"):
        read_array(store.backend, group, sub, None, ".", out)


@pytest.mark.parametrize("dtype", ["object", "<U2", "V8", "M8[s]", "f4,i4", ">f4"])
def test_a_dtype_that_is_not_a_core_type_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """A manifest re-stamped by a writer without the key, naming `object` for an array
    (whose raw bytes read into it would be pointers: the process crashed) or any other
    dtype outside the zarr v3 core types: the version is refused, naming the dtype."""
    store = _store(tmp_path / "s", monkeypatch)
    path = Path(store.backend.path(manifest_path(1)))
    doc = json.loads(path.read_bytes())
    doc["arrays"]["model/b"]["dtype"] = dtype
    os.chmod(path, 0o600)
    path.write_bytes(restamp(doc))
    with pytest.raises(CorruptVersionError, match="not a zarr v3 core data type"):
        Store.open(str(tmp_path / "s"), create=False).latest(stream=lambda _n: False)


_FAULTS = textwrap.dedent(
    """
    import ctypes, resource, sys
    import numpy as np
    from state import Store

    libc = ctypes.CDLL(None)
    libc.mallopt(-4, 0)  # M_MMAP_MAX: every allocation from the heap ...
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: ... which keeps what is freed
    try:  # count 4 KiB pages
        np._core.multiarray._set_madvise_hugepage(False)
    except AttributeError:  # numpy 1
        np.core.multiarray._set_madvise_hugepage(False)
    store = Store.open(sys.argv[1], create=False)

    def restore():
        v = store.latest(stream=lambda _n: False)
        return [v.array(n) for n in v.array_names()]

    total = sum(a.nbytes for a in restore())  # the page cache warm, the heap grown
    faults = []
    for _ in range(3):
        np.ones(total, np.uint8)  # touched and freed: malloc keeps it
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        arrays = restore()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del arrays
    print(min(faults), total // 4096)
    """
)


def test_a_restore_reuses_memory_the_process_freed(tmp_path: Path) -> None:
    """With malloc keeping what is freed, a restore of 73 MiB right after as much was
    freed faults in next to none of its pages: allocated on the read pool, an array over
    64 MiB (glibc's largest thread-arena heap) came from a fresh mapping every time, and
    each of its 18,432 pages faulted in. Counted in a process of its own, which sets
    malloc's options; no time is measured."""
    store = Store.open(str(tmp_path / "s"))
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("ring/a", np.arange(18 << 20, dtype=np.float32))  # 72 MiB, 5 chunks
    txn.put_array("model/w", np.ones((256, 1024), np.float32))  # 1 MiB
    txn.commit()
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, str(tmp_path / "s")],
        capture_output=True,
        text=True,
        check=True,
    )
    faults, pages = (int(x) for x in done.stdout.split())
    assert pages == 73 << 8
    assert faults < pages // 8, done.stdout
