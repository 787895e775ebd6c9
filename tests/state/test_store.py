"""The store conformance suite: every backend (local, memory://, S3) runs the same tests."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from state import (
    ArrayMeta,
    CorruptVersionError,
    FencedError,
    FormatVersionError,
    LeaseHeldError,
    Store,
    StoreError,
    StoreNotFoundError,
    VersionNotFoundError,
)


def _open(loc: dict[str, Any], **kw: Any) -> Store:
    return Store.open(loc["url"], storage_options=loc["storage_options"], **kw)


def _commit(store: Store, step: int, arrays: dict[str, np.ndarray], **records: Any) -> int:
    txn = store.begin(step)
    for k, v in arrays.items():
        txn.put_array(k, v)
    for k, v in records.items():
        txn.put_record(k, v)
    return txn.commit().version


def _files(store: Store) -> set[str]:
    return set(store.backend.find(""))


def test_commit_and_read_back(store_location: dict[str, Any]) -> None:
    store = _open(store_location)
    store.acquire_lease()
    a = np.arange(100, dtype=np.float32).reshape(10, 10)
    v = _commit(store, 5, {"model/w": a, "step": np.array(5)}, sampler={"seed": 3})
    got = _open(store_location, create=False).latest()
    assert got is not None and got.version == v and got.step == 5
    np.testing.assert_array_equal(got.array("model/w"), a)
    assert got.array("step").item() == 5
    assert got.records["sampler"] == {"seed": 3}


def test_incremental_reference_writes_only_new(store_location: dict[str, Any]) -> None:
    store = _open(store_location)
    store.acquire_lease()
    t1 = store.begin(1)
    m = t1.put_array("ring/w-0", np.ones(1000, dtype=np.float32))
    t1.commit()
    t2 = store.begin(2, parent=1)
    t2.reference("ring/w-0", m)
    t2.put_array("ring/w-1", np.full(1000, 2, dtype=np.float32))
    man = t2.commit()
    assert t2.bytes_written == 4000
    assert man.arrays["ring/w-0"].path == m.path
    v = store.latest()
    assert v is not None
    np.testing.assert_array_equal(v.array("ring/w-0"), np.ones(1000, dtype=np.float32))


def test_nothing_visible_before_commit(store_location: dict[str, Any]) -> None:
    store = _open(store_location)
    store.acquire_lease()
    _commit(store, 1, {"a": np.zeros(3)})
    txn = store.begin(2)
    txn.put_array("a", np.ones(3))
    assert store.versions() == [1]
    latest = store.latest()
    assert latest is not None and latest.version == 1


def test_second_writer_refused_and_stale_writer_fenced(store_location: dict[str, Any]) -> None:
    first = _open(store_location)
    first.acquire_lease()
    with pytest.raises(LeaseHeldError, match="second writer is refused"):
        _open(store_location).acquire_lease()
    second = _open(store_location)
    second.acquire_lease(takeover=True)
    with pytest.raises(FencedError, match="taken over"):
        first.begin(1)
    _commit(second, 1, {"a": np.zeros(2)})
    assert second.versions() == [1]


def test_fenced_writer_cannot_commit_a_transaction_begun_before(
    store_location: dict[str, Any],
) -> None:
    first = _open(store_location)
    first.acquire_lease()
    txn = first.begin(1)
    txn.put_array("a", np.zeros(2))
    _open(store_location).acquire_lease(takeover=True)
    with pytest.raises(FencedError):
        txn.commit()
    assert first.versions() == []


def test_released_lease_needs_no_takeover(store_location: dict[str, Any]) -> None:
    s = _open(store_location)
    s.acquire_lease()
    s.release_lease()
    assert _open(store_location).acquire_lease().generation == 2


def _damage(store: Store, kind: str, version: int) -> str:
    man = store.manifest(version)
    path = man.arrays["ring/w"].path
    b = store.backend
    chunk = f"{path}/c.0"
    if kind == "truncate":
        data = b.read_bytes(chunk)
        b.rm(chunk)
        b.fs.pipe_file(b.path(chunk), data[: len(data) // 2])
    elif kind == "bitflip":
        flipped = bytearray(b.read_bytes(chunk))
        flipped[7] ^= 0x10
        b.rm(chunk)
        b.fs.pipe_file(b.path(chunk), bytes(flipped))
    elif kind == "missing":
        b.rm(path, recursive=True)
    elif kind == "manifest":
        rel = f"manifests/{version:08d}.json"
        data = b.read_bytes(rel)
        b.rm(rel)
        b.fs.pipe_file(b.path(rel), data[: len(data) // 2])
        return rel
    return path


@pytest.mark.parametrize("kind", ["truncate", "bitflip", "missing", "manifest"])
def test_damage_is_detected_named_and_fallback_works(
    store_location: dict[str, Any], kind: str
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    for step in (1, 2):
        _commit(store, step, {"ring/w": np.random.default_rng(step).standard_normal(5000)})
    damaged = _damage(store, kind, 2)
    before = _files(store)
    with pytest.raises(CorruptVersionError) as err:
        store.latest()
    assert err.value.version == 2 and err.value.path == damaged
    assert "version 2" in str(err.value) and damaged in str(err.value)
    assert "allow_fallback=True to use version 1" in str(err.value)
    v = store.latest(allow_fallback=True)
    assert v is not None and v.version == 1
    assert _files(store) == before  # a failed open deletes nothing


def test_missing_store_and_foreign_and_newer(store_location: dict[str, Any]) -> None:
    with pytest.raises(StoreNotFoundError, match="holds no cocoon-ckpt store"):
        _open(store_location, create=False)
    store = _open(store_location)
    with pytest.raises(VersionNotFoundError, match="has no version 7"):
        store.read(7)
    root = json.loads(store.backend.read_bytes("zarr.json"))
    root["attributes"]["cocoon_ckpt"]["format_version"] = 99
    store.backend.rm("zarr.json")
    store.backend.fs.pipe_file(store.backend.path("zarr.json"), json.dumps(root).encode())
    with pytest.raises(FormatVersionError, match="newer than this library"):
        _open(store_location)
    root["attributes"] = {}
    store.backend.rm("zarr.json")
    store.backend.fs.pipe_file(store.backend.path("zarr.json"), json.dumps(root).encode())
    with pytest.raises(StoreError, match="not a cocoon-ckpt store"):
        _open(store_location)


def test_retention_keeps_referenced_and_newest(store_location: dict[str, Any]) -> None:
    store = _open(store_location)
    store.acquire_lease()
    t = store.begin(1)
    base = t.put_array("ring/w-0", np.ones(10))
    t.commit()
    for step in range(2, 7):
        t = store.begin(step)
        t.reference("ring/w-0", base)
        t.put_array(f"ring/w-{step}", np.full(10, step, dtype=np.float64))
        t.commit()
    deleted = store.retain(keep_last=2)
    assert store.versions() == [5, 6]
    assert any("manifests/00000001.json" == d for d in deleted)
    for v in store.versions():
        store.read(v)  # every kept version still verifies, incl. the referenced base array


def test_retry_absorbs_transient_errors(
    store_location: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    real = store.backend.create_exclusive
    calls = {"n": 0}

    def flaky(rel: str, data: bytes, on_temp_durable: Any = None) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionResetError("connection reset by peer")
        if calls["n"] == 2:  # lands, but the response is lost
            real(rel, data, on_temp_durable)
            raise TimeoutError("read timed out")
        real(rel, data, on_temp_durable)

    monkeypatch.setattr(store.backend, "create_exclusive", flaky)
    v = _commit(store, 1, {"a": np.zeros(2)})
    assert v == 1 and calls["n"] == 3  # our own landed write was recognised, no conflict
    assert store.latest() is not None


def test_permanent_error_leaves_store_intact(
    store_location: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    _commit(store, 1, {"a": np.zeros(2)})

    def full(*a: Any, **k: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.backend, "create_exclusive", full)
    with pytest.raises(OSError, match="No space"):
        _commit(store, 2, {"a": np.ones(2)})
    monkeypatch.undo()
    v = store.latest()
    assert v is not None and v.version == 1


def test_local_store_is_owner_only(tmp_path: Any) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.put_secret("noise.key", b"k" * 32)
    assert os.stat(tmp_path / "s.zarr").st_mode & 0o077 == 0
    assert os.stat(tmp_path / "s.zarr" / "secret" / "noise.key").st_mode & 0o777 == 0o600


@given(
    arr=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=7),
    )
)
def test_any_array_roundtrips_bit_exact(arr: np.ndarray) -> None:
    import uuid

    store = Store.open(f"memory://rt-{uuid.uuid4().hex}")
    store.acquire_lease()
    _commit(store, 1, {"x": arr})
    got = store.latest()
    assert got is not None
    out = got.array("x")
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert out.tobytes() == np.ascontiguousarray(arr).tobytes()


@settings(max_examples=25, deadline=None)
@given(
    bands=st.integers(2, 6),
    every=st.integers(1, 3),
    keep_last=st.integers(2, 4),
    versions=st.integers(2, 8),
)
def test_retention_never_removes_a_referenced_array(
    bands: int, every: int, keep_last: int, versions: int
) -> None:
    """A ring of b - 1 slots, `every` new slots per version, the rest referenced from
    older versions, retention after each commit: every kept version reads back whole,
    and nothing unreachable is left."""
    import uuid

    store = Store.open(f"memory://retain-{uuid.uuid4().hex}")
    store.acquire_lease()
    ring: list[tuple[int, ArrayMeta]] = []  # (slot number, where it lies), oldest first
    slot = 0
    for step in range(1, versions + 1):
        txn = store.begin(step)
        txn.put_array("model/w", np.full(4, float(step)))
        txn.put_array("optim/m", np.full(4, -float(step)))
        for _ in range(every):
            slot += 1
            ring.append((slot, txn.put_array(f"ring/w-{slot:04d}", np.full(3, float(slot)))))
        ring = ring[-(bands - 1) :]
        for n, meta in ring:
            if not meta.path.startswith(txn.folder + "/"):
                txn.reference(f"ring/w-{n:04d}", meta)
        txn.commit()
        store.retain(keep_last=keep_last)
        assert store.space().unreachable == 0
        for v in store.versions():
            got = store.read(v)
            np.testing.assert_array_equal(got.array("model/w"), np.full(4, float(got.step)))
            for name in got.array_names():
                if name.startswith("ring/"):
                    np.testing.assert_array_equal(got.array(name), np.full(3, float(name[-4:])))
    space = store.space()
    assert space.data == space.referenced + space.scaffolding


def test_a_store_opened_again_sees_what_another_process_wrote_on_s3(
    s3_endpoint: dict[str, Any],
) -> None:
    # s3fs keeps one filesystem per process with its listings cached; a second client
    # (its own instance, as another process has) writes, then this process opens again
    url = f"s3://{s3_endpoint['bucket']}/{uuid.uuid4().hex}.zarr"
    opts = s3_endpoint["storage_options"]
    mine = Store.open(url, storage_options=opts)
    mine.acquire_lease()
    _commit(mine, 1, {"a": np.arange(3)})
    mine.release_lease()
    assert mine.versions() == [1]
    other = Store.open(url, storage_options={**opts, "skip_instance_cache": True})
    other.acquire_lease()
    _commit(other, 2, {"a": np.arange(4)})
    other.release_lease()
    again = Store.open(url, storage_options=opts)
    assert again.versions() == [1, 2]
