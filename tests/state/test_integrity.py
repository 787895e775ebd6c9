"""Manifests verify themselves: every record and the header by checksum, the bytes by
their canonical form, every array path by where it leads; retention deletes nothing
while a manifest fails to verify."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state import (
    CorruptVersionError,
    FormatVersionError,
    Manifest,
    Store,
    UnsafePathError,
    restamp,
)

_RECORDS: dict[str, Any] = {
    "config": {"dp": {"steps": 16, "bands": 4, "noise_multiplier": 1.1}, "seed": 3},
    "fingerprint": "9f2c" * 16,
    "optimizer": {"param_groups": [{"lr": 0.1, "eps": 1e-05, "betas": [0.9, 0.999]}]},
    "sampler": {"seed": 3, "partitions": 4, "cursor": 2},
    "accountant": {"steps": 2, "epsilon": 1.25, "delta": 1e-05},
    "noise": {"t": 2, "head": 0, "shards": [{"slots": [[0, 0, "ring/w-0"], [1, 1, "ring/w-1"]]}]},
    "embedding": {"cursor": 2, "tables": [{"param": "emb", "plan": {"mode": "csc", "hot": 3}}]},
    "placement": [{"tier": "host", "start": 0, "stop": 6}],
    "complete": False,
    "name": "caf\u00e9",
}


def _commit(store: Store, step: int, **extra: Any) -> int:
    txn = store.begin(step)
    txn.put_array("model/w", np.arange(6, dtype=np.float32) * step)
    txn.put_array(f"ring/w-{step}", np.full((2, 3), step, dtype=np.float64))
    for name, rec in {**_RECORDS, **extra}.items():
        txn.put_record(name, rec)
    return txn.commit().version


def _small_store(root: Path) -> Store:
    """Two versions of a few arrays (one shared) and nested records."""
    store = Store.open(str(root))
    store.acquire_lease()
    shared = store.put_shared("tok/emb/order", np.arange(5))
    for step in (1, 2):
        txn = store.begin(step)
        txn.put_array("model/w", np.arange(6, dtype=np.float32) * step)
        txn.put_array(f"ring/w-{step}", np.full((2, 3), step, dtype=np.float64))
        txn.reference("emb/order", shared)
        for name, rec in _RECORDS.items():
            txn.put_record(name, rec)
        txn.commit()
    store.release_lease()
    return store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return _small_store(tmp_path / "s.zarr")


def _manifest_file(store: Store, v: int) -> Path:
    return Path(store.backend.path(f"manifests/{v:08d}.json"))


def _tree(root: Path) -> dict[str, str]:
    """Every path under `root` with its mode and content hash."""
    out = {}
    for p in sorted([root, *root.rglob("*")]):
        st_ = p.lstat()
        body = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "-"
        out[str(p.relative_to(root))] = f"{st_.st_mode:o}:{body}"
    return out


# records integrity ----------------------------------------------------------------
def test_every_single_bit_flip_is_detected_on_open(store: Store) -> None:
    path = _manifest_file(store, 2)
    raw = path.read_bytes()
    names = set(json.loads(raw)["records"]) | {"header"}

    @settings(max_examples=100)
    @given(bit=st.integers(0, len(raw) * 8 - 1))
    def flip(bit: int) -> None:
        data = bytearray(raw)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))
        try:
            with pytest.raises((CorruptVersionError, FormatVersionError)) as err:
                store.manifest(2)
        finally:
            path.write_bytes(raw)
        exc = err.value
        if isinstance(exc, CorruptVersionError):
            assert exc.version == 2 and exc.path == "manifests/00000002.json"
            assert "version 2" in str(exc)
            if "not valid JSON" not in str(exc):  # parsed: the damaged record is named
                assert exc.record in names, str(exc)

    flip()
    assert store.manifest(2).records == json.loads(raw)["records"]


def test_a_bit_flip_at_every_byte_is_detected_and_named(store: Store) -> None:
    raw = _manifest_file(store, 2).read_bytes()
    names = set(json.loads(raw)["records"]) | {"header"}
    silent, named = [], {"header": 0}
    for i in range(len(raw)):  # every byte, the flipped bit cycling through all eight
        data = bytearray(raw)
        data[i] ^= 1 << (i % 8)
        try:
            Manifest.from_bytes(bytes(data), version=2, where="s")
            silent.append(i)
        except FormatVersionError:
            continue
        except CorruptVersionError as exc:
            if "not valid JSON" not in str(exc):
                assert exc.record in names, (i, str(exc))
                named[exc.record] = named.get(exc.record, 0) + 1
    assert silent == []
    # a flip inside each record is blamed on that record, not on the header
    assert set(named) == names


def test_record_value_flips_name_the_record(store: Store) -> None:
    path = _manifest_file(store, 2)
    raw = path.read_bytes()
    # lr 0.1 -> 0.3: one bit ('1' 0x31 -> '3' 0x33), still valid JSON
    assert raw.count(b'"lr": 0.1') == 1
    path.write_bytes(raw.replace(b'"lr": 0.1', b'"lr": 0.3'))
    with pytest.raises(CorruptVersionError) as err:
        store.latest()
    assert err.value.version == 2 and err.value.record == "optimizer"
    assert "record 'optimizer'" in str(err.value) and "checksum" in str(err.value)
    assert "allow_fallback=True to use version 1" in str(err.value)
    v = store.latest(allow_fallback=True)
    assert v is not None and v.version == 1 and v.records["optimizer"] == _RECORDS["optimizer"]

    # a ring slot's step 0 -> 1 (the wrong w would be mixed in): the noise record
    doc = json.loads(raw)
    doc["records"]["noise"]["shards"][0]["slots"][0][1] = 1
    path.write_bytes(json.dumps(doc, sort_keys=True, indent=1).encode())
    with pytest.raises(CorruptVersionError) as err:
        store.read(2)
    assert err.value.record == "noise" and "record 'noise'" in str(err.value)

    # the header: step 2 -> 3
    doc = json.loads(raw)
    doc["step"] = 3
    path.write_bytes(json.dumps(doc, sort_keys=True, indent=1).encode())
    with pytest.raises(CorruptVersionError) as err:
        store.manifest(2)
    assert err.value.record == "header" and "header" in str(err.value)


def test_a_flip_that_parses_to_the_same_value_is_caught(store: Store) -> None:
    path = _manifest_file(store, 2)
    raw = path.read_bytes()
    assert raw.count(b'"eps": 1e-05') == 1  # 'e' 0x65 -> 'E' 0x45: equal as a float
    path.write_bytes(raw.replace(b'"eps": 1e-05', b'"eps": 1E-05'))
    assert json.loads(path.read_bytes()) == json.loads(raw)
    with pytest.raises(CorruptVersionError, match="canonical form") as err:
        store.manifest(2)
    assert err.value.record == "optimizer"
    path.write_bytes(raw.replace(b"\\u00e9", b"\\u00E9"))  # the same string
    with pytest.raises(CorruptVersionError, match="canonical form") as err:
        store.manifest(2)
    assert err.value.record == "name"


def test_format_1_manifest_is_refused_saying_why(store: Store) -> None:
    path = _manifest_file(store, 2)
    doc = json.loads(path.read_bytes())
    for k in ("record_checksums", "header_checksum"):
        del doc[k]
    doc["format_version"] = 1
    path.write_text(json.dumps(doc, sort_keys=True, indent=1))
    with pytest.raises(FormatVersionError, match="carries no record checksums"):
        store.latest(allow_fallback=True)


def test_restamp_is_what_a_writer_who_recomputes_checksums_stores(store: Store) -> None:
    path = _manifest_file(store, 2)
    doc = json.loads(path.read_bytes())
    assert restamp(doc) == path.read_bytes()  # the canonical bytes, fresh checksums
    doc["records"]["optimizer"]["param_groups"][0]["lr"] = 0.3
    path.write_bytes(restamp(doc))
    got = store.manifest(2).records["optimizer"]["param_groups"][0]["lr"]
    assert got == 0.3  # integrity, not authenticity: audit's regeneration is the check


# paths confined to the store --------------------------------------------------------
def _retarget(store: Store, array: str, path: str) -> None:
    """Point version 2's `array` at `path`, re-stamping the checksums as an attacker
    who can recompute them would."""
    f = _manifest_file(store, 2)
    doc = json.loads(f.read_bytes())
    doc["arrays"][array]["path"] = path
    f.write_bytes(restamp(doc))


@pytest.mark.parametrize(
    "bad",
    [
        "../../other.zarr/versions/00000001-g1/model/w",
        "versions/00000002-g1/../../../other.zarr/versions/00000001-g1/model/w",
        "{other}/versions/00000001-g1/model/w",  # absolute
        "versions\\00000002-g1\\model\\w",
        "versions//00000002-g1/model/w",
        "versions/00000002-g1/model/w/",
        "",
        "manifests/00000001.json",
        "secret/noise.key",
        "versions/elsewhere/model/w",
        "versions/00000002-g1",
        "shared",
    ],
)
def test_array_path_outside_the_store_is_refused(store: Store, tmp_path: Path, bad: str) -> None:
    other = _small_store(tmp_path / "other.zarr")  # a real target: following it would work
    bad = bad.format(other=other.backend.root)
    _retarget(store, "model/w", bad)
    with pytest.raises(UnsafePathError) as err:
        store.manifest(2)
    exc = err.value
    assert exc.version == 2 and exc.array == "model/w" and exc.path == bad
    assert f"array 'model/w' has path {bad!r}" in str(exc)
    assert isinstance(exc, CorruptVersionError)  # fallback works as for any damage
    with pytest.raises(UnsafePathError):
        store.latest()
    v = store.latest(allow_fallback=True)
    assert v is not None and v.version == 1


def test_symlink_leading_outside_the_store_is_refused(store: Store, tmp_path: Path) -> None:
    root = Path(store.backend.root)
    meta = store.manifest(2).arrays["ring/w-2"]
    folder = root / meta.path.rsplit("/", 2)[0]  # versions/00000002-g1
    outside = tmp_path / "outside"
    # the version folder itself moved out and linked back
    shutil.move(folder, outside)
    folder.symlink_to(outside)
    store.read(1)  # version 1 is untouched
    with pytest.raises(UnsafePathError, match="resolves outside the store root") as err:
        store.read(2)
    assert err.value.version == 2 and err.value.array in store.manifest(2).arrays
    folder.unlink()
    shutil.move(outside, folder)
    store.read(2)
    # one chunk file linked to a copy outside
    chunk = root / meta.path / "c.0.0"
    shutil.copy(chunk, tmp_path / "chunk")
    chunk.unlink()
    chunk.symlink_to(tmp_path / "chunk")
    with pytest.raises(UnsafePathError) as err:
        store.read(2)
    assert err.value.array == "ring/w-2" and str(chunk) in str(err.value)
    # a link that stays inside the store is followed
    chunk.unlink()
    (root / "shared" / "copy").write_bytes((tmp_path / "chunk").read_bytes())
    chunk.symlink_to(root / "shared" / "copy")
    np.testing.assert_array_equal(store.read(2).array("ring/w-2"), np.full((2, 3), 2.0))


# retention ---------------------------------------------------------------------------
def _four_versions(root: Path) -> Store:
    store = Store.open(str(root))
    store.acquire_lease()
    for step in (1, 2, 3, 4):
        _commit(store, step)
    return store


@pytest.mark.parametrize("damage", ["record", "torn"])
def test_retention_deletes_nothing_while_a_manifest_is_damaged(tmp_path: Path, damage: str) -> None:
    store = _four_versions(tmp_path / "s.zarr")
    path = _manifest_file(store, 2)
    raw = path.read_bytes()
    if damage == "record":  # one bit: repairable, if its arrays are still there
        path.write_bytes(raw.replace(b'"lr": 0.1', b'"lr": 0.3'))
    else:
        path.write_bytes(raw[: len(raw) // 2])
    before = _tree(tmp_path / "s.zarr")
    with pytest.raises(CorruptVersionError) as err:
        store.retain(keep_last=2)
    assert err.value.version == 2
    assert "retention stopped, nothing was deleted" in str(err.value)
    assert "discard_damaged=True" in str(err.value)
    assert _tree(tmp_path / "s.zarr") == before
    # repaired, retention goes on and version 2 is deleted as any old version
    path.write_bytes(raw)
    store.retain(keep_last=2)
    assert store.versions() == [3, 4]


def test_retention_discards_damaged_only_when_asked(tmp_path: Path) -> None:
    store = _four_versions(tmp_path / "s.zarr")
    path = _manifest_file(store, 4)  # the newest
    path.write_bytes(path.read_bytes().replace(b'"lr": 0.1', b'"lr": 0.3'))
    deleted = store.retain(keep_last=2, discard_damaged=True)
    assert store.versions() == [2, 3]  # two verifiable versions stay
    assert "manifests/00000004.json" in deleted and "manifests/00000001.json" in deleted
    assert sorted(os.listdir(tmp_path / "s.zarr" / "versions")) == [
        "00000002-g1",
        "00000003-g1",
        "zarr.json",
    ]
    for v in store.versions():
        store.read(v)
