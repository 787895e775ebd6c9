"""Past `state.version.KEEP_BYTES`, a version reads an array once when memory allows
(`SPARE_SHARE`): verified whole and held for one read, handed over by `Version.array` and
held no longer; what memory does not allow is checked by a streamed pass and read again
when asked for, as before. Every byte is verified before it is handed over either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import state.version
from state import CorruptVersionError, Store
from state.arrays import chunk_key

KiB = 1 << 10


def _arrays(step: int) -> dict[str, np.ndarray]:
    """Four 32 KiB arrays: with `KEEP_BYTES` 40 KiB the first is kept, the rest overflow."""
    return {
        f"ring/{name}": np.arange(4 * KiB, dtype=np.int64) * step + i
        for i, name in enumerate("abcd")
    }


def _store(root: Path, versions: int = 2) -> Store:
    store = Store.open(str(root))
    store.acquire_lease()
    for step in range(1, versions + 1):
        txn = store.begin(step)
        for name, a in _arrays(step).items():
            txn.put_array(name, a)
        txn.commit()
    return store


def _reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Record every whole read and every streamed pass, by array name."""
    got: dict[str, list[str]] = {"whole": [], "streamed": []}
    whole, streamed = state.version.read_array, state.version.verify_array

    def read(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        got["whole"].append(name.rsplit("/", 1)[-1])
        return whole(backend, group, name, *a, **k)

    def stream(backend: Any, group: str, name: str, *a: Any, **k: Any) -> Any:
        got["streamed"].append(name.rsplit("/", 1)[-1])
        return streamed(backend, group, name, *a, **k)

    monkeypatch.setattr(state.version, "read_array", read)
    monkeypatch.setattr(state.version, "verify_array", stream)
    return got


def test_an_array_past_what_a_version_keeps_is_read_once_when_memory_allows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`a` is kept, `b` (within the spare `KEEP_BYTES`) read whole once and handed over
    once, `c` and `d` (past the spare) streamed and read again; every value is the stored
    one, and `b` asked for again is read again (held no longer)."""
    monkeypatch.setattr(state.version, "KEEP_BYTES", 40 * KiB)
    _store(tmp_path / "s")
    reads = _reads(monkeypatch)
    version = Store.open(str(tmp_path / "s"), create=False).latest()
    assert version is not None and version.step == 2
    assert sorted(reads["whole"]) == ["a", "b"]
    assert sorted(reads["streamed"]) == ["c", "d"]
    for name, want in _arrays(2).items():
        assert np.array_equal(version.array(name), want)
    assert sorted(reads["whole"]) == ["a", "b", "c", "d"]  # b not read again
    assert np.array_equal(version.array("ring/b"), _arrays(2)["ring/b"])
    assert sorted(reads["whole"]) == ["a", "b", "b", "c", "d"]
    assert np.array_equal(version.array("ring/a"), _arrays(2)["ring/a"])  # kept
    assert reads["whole"].count("a") == 1


def test_without_memory_to_spare_the_overflow_is_streamed_and_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the memory available is too little (or unknown: 0), nothing past
    `KEEP_BYTES` is held: each overflowing array is checked by a streamed pass and read
    again when asked for."""
    monkeypatch.setattr(state.version, "KEEP_BYTES", 40 * KiB)
    monkeypatch.setattr(state.version, "available_memory", lambda: 0)
    _store(tmp_path / "s")
    reads = _reads(monkeypatch)
    version = Store.open(str(tmp_path / "s"), create=False).latest()
    assert version is not None
    assert reads["whole"] == ["a"]
    assert sorted(reads["streamed"]) == ["b", "c", "d"]
    for name, want in _arrays(2).items():
        assert np.array_equal(version.array(name), want)
    assert sorted(reads["whole"]) == ["a", "b", "c", "d"]


def test_the_spare_is_bounded_by_the_memory_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eighth of the memory available (here 8 x 40 KiB: one 32 KiB array) bounds
    what is held past `KEEP_BYTES`, however large `KEEP_BYTES` leaves the spare."""
    monkeypatch.setattr(state.version, "KEEP_BYTES", 40 * KiB)
    monkeypatch.setattr(state.version, "available_memory", lambda: 8 * 40 * KiB)
    monkeypatch.setattr(state.version, "SPARE_SHARE", 8)
    _store(tmp_path / "s")
    reads = _reads(monkeypatch)
    assert Store.open(str(tmp_path / "s"), create=False).latest() is not None
    assert sorted(reads["whole"]) == ["a", "b"]
    assert sorted(reads["streamed"]) == ["c", "d"]


def test_a_damaged_array_held_for_one_read_refuses_the_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flipped byte in the array read whole past `KEEP_BYTES` is a CorruptVersionError
    naming the array and the version, and a fallback uses the version before."""
    monkeypatch.setattr(state.version, "KEEP_BYTES", 40 * KiB)
    root = tmp_path / "s"
    store = _store(root)
    meta = store.manifest(store.versions()[-1]).arrays["ring/b"]
    chunk = root / meta.path / chunk_key(0, len(meta.shape), meta.separator)
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x40
    chunk.write_bytes(bytes(raw))
    reads = _reads(monkeypatch)
    with pytest.raises(CorruptVersionError, match=r"version 2 .*ring/b"):
        Store.open(str(root), create=False).latest()
    assert "b" in reads["whole"] and "b" not in reads["streamed"]
    back = Store.open(str(root), create=False).latest(allow_fallback=True)
    assert back is not None and back.step == 1
    assert np.array_equal(back.array("ring/b"), _arrays(1)["ring/b"])
