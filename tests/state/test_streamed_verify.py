"""Verifying a version streams its large arrays (`state.version.STREAM_BYTES`): a piece
of each in memory at a time, never the whole array, with the verdicts of reading it
whole (a flipped byte, a torn, grown or missing chunk, a chunk re-stamped to pass its
own crc are each a CorruptVersionError naming the array and the version, and
`latest(allow_fallback=True)` falls back); the array is read whole only when asked."""

from __future__ import annotations

import tempfile
import tracemalloc
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import state.arrays
import state.version
from state import CorruptVersionError, Store
from state.arrays import chunk_key, verify_array, write_array
from state.checksum import array_checksum
from state.local_backend import LocalBackend
from state.paths import array_group

BIG = "ring/big"


def _store(root: Path, big: np.ndarray, versions: int = 2) -> Store:
    """`versions` versions, each of `BIG` (the last one `big`) and a small array."""
    store = Store.open(str(root))
    store.acquire_lease()
    for step in range(1, versions + 1):
        txn = store.begin(step)
        txn.put_array(BIG, big if step == versions else big[: big.shape[0] // 2] + step)
        txn.put_array("model/w", np.arange(6, dtype=np.float32) * step)
        txn.commit()
    return store


def _no_whole_reads(monkeypatch: pytest.MonkeyPatch, of: str) -> list[str]:
    """Record every whole read of an array, refusing one of `of` (its path's tail)."""
    whole: list[str] = []
    real = state.version.read_array

    def spy(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        whole.append(name)
        assert not name.endswith(of), f"{group}/{name} read whole"
        return real(backend, group, name, *a, **k)

    monkeypatch.setattr(state.version, "read_array", spy)
    return whole


def test_a_large_array_is_verified_without_holding_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An array 20 times `STREAM_BYTES` (two chunk files) verifies with allocations
    peaking below a tenth of it; it is read whole only when asked for, and then is the
    stored one."""
    monkeypatch.setattr(state.version, "STREAM_BYTES", 1 << 20)
    big = np.random.default_rng(0).standard_normal(5 << 20, dtype=np.float32)  # 20 MiB
    _store(tmp_path / "s", big)
    whole = _no_whole_reads(monkeypatch, BIG.split("/")[-1])
    store = Store.open(str(tmp_path / "s"), create=False)
    tracemalloc.start()
    try:
        version = store.latest()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert version is not None and version.step == 2
    assert peak < big.nbytes / 10, (peak, big.nbytes)
    assert whole == ["model/w"]  # the small one is read whole, and kept
    monkeypatch.setattr(state.version, "read_array", state.arrays.read_array)
    assert np.array_equal(version.array(BIG), big)


def test_an_array_the_cache_would_not_keep_is_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below `STREAM_BYTES` but past what `KEEP_BYTES` keeps: streamed too."""
    monkeypatch.setattr(state.version, "KEEP_BYTES", 1 << 10)
    _store(tmp_path / "s", np.arange(4096, dtype=np.int64))
    _no_whole_reads(monkeypatch, "big")
    version = Store.open(str(tmp_path / "s"), create=False).latest()
    assert version is not None and version.step == 2


def _chunk_file(root: Path, store: Store, index: int) -> Path:
    meta = store.manifest(store.versions()[-1]).arrays[BIG]
    return root / meta.path / chunk_key(index, len(meta.shape), meta.separator)


def _flip(at: int) -> Callable[[bytearray], bytearray]:
    def go(raw: bytearray) -> bytearray:
        raw[at % len(raw)] ^= 0x40
        return raw

    return go


def _restamp(raw: bytearray) -> bytearray:
    """A changed byte, and the chunk's trailer made to match it: only the manifest's
    checksum of the whole array can tell."""
    raw[0] ^= 0x01
    raw[-4:] = crc32c.crc32c(bytes(raw[:-4])).to_bytes(4, "little")
    return raw


_DAMAGE: dict[str, Callable[[bytearray], bytearray] | None] = {
    "flipped payload byte": _flip(5),
    "flipped last payload byte": _flip(-5),
    "flipped crc trailer": _flip(-1),
    "torn": lambda raw: raw[: len(raw) // 2],
    "grown": lambda raw: raw + b"\0",
    "re-stamped (wrong checksum)": _restamp,
    "missing": None,
}


@pytest.mark.parametrize("kind", sorted(_DAMAGE))
@pytest.mark.parametrize("chunk", [0, 1])
def test_every_damage_is_caught_by_the_streamed_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, chunk: int
) -> None:
    """Each damage to either chunk of a streamed array: a CorruptVersionError naming the
    array and the version, the version refused, and a fallback to the one before."""
    monkeypatch.setattr(state.version, "STREAM_BYTES", 0)
    monkeypatch.setattr(state.arrays, "CHUNK_BYTES", 1 << 12)
    root = tmp_path / "s"
    store = _store(root, np.arange(1024, dtype=np.int64).reshape(256, 4))  # two chunks
    path = _chunk_file(root, store, chunk)
    damage = _DAMAGE[kind]
    if damage is None:
        path.unlink()
    else:
        raw = damage(bytearray(path.read_bytes()))
        path.chmod(0o644)
        path.write_bytes(bytes(raw))
    whole = _no_whole_reads(monkeypatch, "big")
    meta = store.manifest(2).arrays[BIG]
    with pytest.raises(CorruptVersionError, match=f"version 2 of .*{meta.path}") as err:
        store.read(2)
    assert err.value.version == 2 and err.value.path == meta.path
    assert not whole or whole == ["model/w"]
    older = store.latest(allow_fallback=True)
    assert older is not None and older.version == 1


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(0, 300),
    width=st.integers(1, 7),
    dtype=st.sampled_from(["uint8", "int16", "float32", "complex128"]),
    chunk_bytes=st.integers(1, 3000),
    piece=st.integers(1, 700),
    flip=st.integers(0, 1 << 20),
)
def test_streamed_checks_agree_with_reading_whole(
    rows: int, width: int, dtype: str, chunk_bytes: int, piece: int, flip: int
) -> None:
    """For any chunk and piece sizes: the streamed pass returns the whole read's
    checksum, hands over every byte once and in order, and a flipped byte anywhere in a
    chunk file fails it as it fails the whole read."""
    arr = (np.arange(rows * width) % 251).astype(dtype).reshape(rows, width)
    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as tmp:
        mp.setattr(state.arrays, "CHUNK_BYTES", chunk_bytes)
        mp.setattr(state.arrays, "_PIECE", piece)
        backend = LocalBackend(tmp)
        got, chunks = write_array(backend, "g", "a", arr)
        layout = (arr.shape, dtype, chunks)
        seen = bytearray()

        def feed(offset: int, data: memoryview) -> None:
            assert offset == len(seen) and 0 < len(data) <= piece
            seen.extend(data)

        assert verify_array(backend, "g", "a", layout, ".", feed) == got == array_checksum(arr)
        assert bytes(seen) == arr.tobytes()
        files = sorted(p for p in Path(tmp, "g", "a").iterdir() if p.name != "zarr.json")
        if not files:
            return
        target = files[flip % len(files)]
        raw = bytearray(target.read_bytes())
        raw[flip % len(raw)] ^= 0x10
        target.chmod(0o644)
        target.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match="crc32c"):
            verify_array(backend, "g", "a", layout, ".")
        with pytest.raises(ValueError, match="crc32c"):
            state.arrays.read_array(backend, "g", "a", layout, ".")


def test_an_object_store_array_is_streamed_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a remote backend (fsspec's memory://) the streamed pass reads a chunk at a
    time, hands over every byte, and a flipped byte in an edge chunk (with padding)
    is caught."""
    monkeypatch.setattr(state.version, "STREAM_BYTES", 0)
    monkeypatch.setattr(state.arrays, "CHUNK_BYTES", 1000)
    store = Store.open(f"memory://streamed-verify-{uuid.uuid4().hex}")
    store.acquire_lease()
    arr = np.arange(1001, dtype=np.int32).reshape(-1, 1)  # 250 rows a chunk, then 1
    txn = store.begin(1)
    txn.put_array("a/b", arr)
    txn.commit()
    _no_whole_reads(monkeypatch, "a/b")
    meta = store.manifest(1).arrays["a/b"]
    seen = bytearray()
    group, name = array_group(meta.path)
    layout = (meta.shape, meta.dtype, meta.chunks)
    got = verify_array(
        store.backend, group, name, layout, meta.separator, lambda _, d: seen.extend(d)
    )
    assert got == meta.checksum and bytes(seen) == arr.tobytes()
    assert store.read(1).version == 1
    rel = store.backend.path(f"{meta.path}/{chunk_key(4, 2, meta.separator)}")
    raw = bytearray(store.backend.fs.cat_file(rel))
    raw[1] ^= 0x01
    store.backend.fs.pipe_file(rel, bytes(raw))
    with pytest.raises(CorruptVersionError, match="fails its crc32c") as err:
        store.read(1)
    assert err.value.version == 1 and err.value.path == meta.path
