"""The packed layout: the generators' states held in the `rng` record (`format.packed`)
instead of arrays of their own. Its golden store (`golden/format_store_packed`, from
`write_packed_golden`) decodes to the state that wrote it and encoding that state today
gives its bytes; a packed and an unpacked version of one state restore the same state;
a job resumed from versions of the old layout continues bit-identically and writes the
packed one; a damaged or forged byte of the packed record is caught by every reader."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt import run_job
from cocoon_ckpt.format import codec
from cocoon_ckpt.format.codec import decode, encode
from cocoon_ckpt.format.packed import MAX_PACKED_BYTES, pack_array, unpack_array
from cocoon_ckpt.format.parts import rng
from cocoon_ckpt.train import checkpoint
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, Trace, crash_at, disarm_all, golden, verify
from fault_injection.forgery import forge_manifest
from state import CorruptVersionError, Manifest, Store, Version
from state.paths import manifest_path

from .conftest import job_config, reseal, tree
from .test_format_golden import GOLDEN, STEPS, _equal, synthetic_state

PACKED_GOLDEN = GOLDEN.parent / "format_store_packed"
ROOT = Path(__file__).resolve().parents[2]


def write_packed_golden(root: Path) -> None:
    """The packed layout's golden store: `synthetic_state` of each step of `STEPS`,
    encoded packed against its parent, as a checkpointer writes them."""
    store = Store.open(str(root))
    store.acquire_lease()
    parent: Manifest | None = None
    for step in STEPS:
        snap = encode(synthetic_state(step), parent, packed=True)
        txn = store.begin(step, parent=parent.version if parent is not None else None)
        for name, arr in snap.arrays.items():
            txn.put_array(name, arr)
        for name, meta in snap.references.items():
            txn.reference(name, meta)
        for name, rec in snap.records.items():
            txn.put_record(name, rec)
        parent = txn.commit()
    store.release_lease()


def _copy(src: Path, tmp: Path) -> Store:
    root = tmp / src.name
    shutil.copytree(src, root)
    return Store.open(str(root), create=False)


def _version(store: Store, step: int) -> Version:
    return store.read(store.versions()[STEPS.index(step)])


@pytest.mark.parametrize(
    "a",
    [
        np.arange(5056, dtype=np.uint8),
        np.arange(624, dtype=np.uint32) * 2654435761,
        np.array([2**63 + 5, 7], dtype=np.uint64),
        np.array([[-1, 2], [3, -4]], dtype=np.int64),
        np.zeros(0, dtype=np.uint8),
        np.array(9, dtype=np.uint32),
        np.arange(8, dtype=">u4"),  # big-endian in memory: stored little-endian, same values
    ],
    ids=["torch", "numpy", "uint64", "int64-2d", "empty", "0-d", "big-endian"],
)
def test_a_packed_array_reads_back_bit_for_bit(a: np.ndarray) -> None:
    rec = pack_array(a)
    assert base64.b64decode(rec["data"]) == a.astype(a.dtype.newbyteorder("<")).tobytes()
    got = unpack_array(json.loads(json.dumps(rec)))  # as the manifest keeps it
    assert got.dtype == a.dtype.newbyteorder("=") and got.shape == a.shape
    assert np.array_equal(got, a) and got.flags.writeable


def _bad(**edit: Any) -> dict[str, Any]:
    rec: dict[str, Any] = dict(pack_array(np.arange(6, dtype=np.uint32)))
    rec.update(edit)
    return rec


@pytest.mark.parametrize(
    ("rec", "says"),
    [
        (_bad(dtype="float32"), "dtype 'float32'"),
        (_bad(shape=[7]), "base64 characters"),
        (_bad(shape=[-6]), "shape"),
        (_bad(shape=[1 << 20]), "shape"),
        (_bad(shape=[4096, 4096]), f"at most {MAX_PACKED_BYTES}"),
        (_bad(data="!" * 32), "not base64"),
        (_bad(data="AAAA" * 7 + "AA=="), "holds 22 bytes"),  # the length of 24 bytes
        ({**_bad(), "extra": 1}, "{dtype, shape, data}"),
        ([1, 2], "{dtype, shape, data}"),
    ],
    ids=["dtype", "shape", "negative", "huge-axis", "huge", "base64", "short", "extra", "list"],
)
def test_a_malformed_packed_array_is_refused_before_it_is_decoded(rec: Any, says: str) -> None:
    with pytest.raises(ValueError, match="packed array") as err:
        unpack_array(rec)
    assert says in str(err.value)


def test_the_packed_golden_store_holds_no_generator_array(tmp_path: Path) -> None:
    store = _copy(PACKED_GOLDEN, tmp_path)
    for v in store.versions():
        version = store.read(v)
        assert not any(n.startswith("rng/") for n in version.array_names())
        assert set(version.records["rng"]["packed"]) == {"torch", "numpy"}
    old = _copy(GOLDEN, tmp_path)
    for v, w in zip(store.versions(), old.versions(), strict=True):
        # the same arrays less the generators' (each of which was a zarr.json and a chunk)
        names = set(old.read(w).array_names())
        assert set(store.read(v).array_names()) == {n for n in names if not n.startswith("rng/")}


@pytest.mark.parametrize("step", STEPS)
def test_the_packed_golden_version_decodes_to_the_state_that_wrote_it(
    tmp_path: Path, step: int
) -> None:
    version = _version(_copy(PACKED_GOLDEN, tmp_path), step)
    want = synthetic_state(step)
    got = decode(version, synthetic_state(0))
    got["noise_layout"] = want["noise_layout"]
    assert _equal(got["noise"]["ring"], want["noise"]["ring"])
    got["noise"]["ring"] = want["noise"]["ring"]
    for part in want:
        assert _equal(got[part], want[part]), part


@pytest.mark.parametrize("step", STEPS)
def test_encoding_packed_today_gives_the_packed_golden_bytes(tmp_path: Path, step: int) -> None:
    store = _copy(PACKED_GOLDEN, tmp_path)
    version = _version(store, step)
    manifest = version.manifest
    parent = store.manifest(manifest.parent) if manifest.parent is not None else None
    snap = encode(synthetic_state(step), parent, packed=True)
    assert set(snap.arrays) | set(snap.references) == set(version.array_names())
    for name, arr in snap.arrays.items():
        assert arr.tobytes() == version.array(name).tobytes(), name
    for name, meta in snap.references.items():
        assert meta == manifest.arrays[name], name
    assert snap.records == dict(version.records)


@pytest.mark.parametrize("step", STEPS)
def test_a_packed_and_an_unpacked_version_restore_the_same_state(tmp_path: Path, step: int) -> None:
    new_version = _version(_copy(PACKED_GOLDEN, tmp_path), step)
    old_version = _version(_copy(GOLDEN, tmp_path), step)
    packed = decode(new_version, synthetic_state(0))
    old = decode(old_version, synthetic_state(0))
    for part in old:
        assert _equal(packed[part], old[part]), part
    # and the records differ only by where the generators' states lie
    new_rec, old_rec = dict(new_version.records), dict(old_version.records)
    assert new_rec.keys() == old_rec.keys()
    assert {k for k in old_rec if new_rec[k] != old_rec[k]} == {"rng"}
    assert {k: v for k, v in new_rec["rng"].items() if k != "packed"} == old_rec["rng"]


def _flip_packed_byte(doc: dict[str, Any]) -> str:
    """Flip one bit of the torch generator's state inside the rng record."""
    torch_state = doc["records"]["rng"]["packed"]["torch"]
    raw = bytearray(base64.b64decode(torch_state["data"]))
    raw[100] ^= 0x01
    torch_state["data"] = base64.b64encode(bytes(raw)).decode("ascii")
    return "one bit of the torch generator's state"


def test_a_damaged_byte_of_the_packed_record_is_named_on_open(tmp_path: Path) -> None:
    store = _copy(PACKED_GOLDEN, tmp_path)
    v = store.versions()[-1]
    path = Path(store.url) / manifest_path(v)
    doc = json.loads(path.read_bytes())
    _flip_packed_byte(doc)
    path.write_bytes(json.dumps(doc, sort_keys=True, indent=1).encode())  # checksums stale
    with pytest.raises(CorruptVersionError) as err:
        Store.open(store.url, create=False).read(v)
    assert err.value.record == "rng"


def test_a_malformed_packed_state_is_refused_by_the_decoder(tmp_path: Path) -> None:
    version = _version(_copy(PACKED_GOLDEN, tmp_path), STEPS[-1])
    rec = json.loads(json.dumps(version.records["rng"]))
    del rec["packed"]["numpy"]
    with pytest.raises(ValueError, match=r"packs \['torch'\], not the states of"):
        rng.decode(rec, version)
    rec = json.loads(json.dumps(version.records["rng"]))
    rec["packed"]["numpy"]["shape"] = [623]
    with pytest.raises(ValueError, match="rng record's numpy state: a packed"):
        rng.decode(rec, version)


# --- real jobs: a resume from the old layout, forgeries ---------------------------------


def _model_checksums(store: Store, version: int) -> dict[str, str]:
    arrays = store.manifest(version).arrays
    return {k: m.checksum for k, m in arrays.items() if k.startswith("model/")}


def test_a_resume_from_old_layout_versions_is_bit_identical_and_writes_the_packed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = job_config("mlp", bands=8, steps=24, keep_last=10)  # a version every 5 steps, all kept
    key = str(tmp_path / "k")
    opts = JobOptions(key_file=key)
    ref_url = str(tmp_path / "gold.zarr")
    reference = golden(cfg, ref_url, options=opts)
    url = str(tmp_path / "run.zarr")

    def old_layout(*args: Any, **kw: Any) -> codec.Snapshot:
        return encode(*args, **{**kw, "packed": False})

    monkeypatch.setattr(checkpoint, "encode", old_layout)  # as written before the packing
    crashed = Trace()
    crash_at("trainer.after_update", step=12)
    try:
        with pytest.raises(CrashPointHit):
            run_job(cfg, url, on_step=crashed.record, options=opts)
    finally:
        disarm_all()
    monkeypatch.undo()
    store = Store.open(url, create=False)
    old = [store.read(v) for v in store.versions()]
    assert [v.step for v in old] == [5, 10]
    for v in old:
        assert {"rng/torch", "rng/numpy"} <= set(v.array_names())
        assert "packed" not in v.records["rng"]
    ref = Store.open(ref_url, create=False)
    ref_versions = {ref.read(v).step: ref.read(v) for v in ref.versions()}
    # an old-layout version and the packed one of the same step restore the same state
    for v in old:
        like = ref_versions[v.step]
        assert like.records["rng"]["packed"]
        a, b = rng.decode(v.records["rng"], v), rng.decode(like.records["rng"], like)
        assert _equal(a, b)

    trace, divergence = verify(cfg, url, [], reference, crashed, options=opts)
    assert divergence is None, str(divergence)
    resumed = Store.open(url, create=False)
    new = [resumed.read(v) for v in resumed.versions() if resumed.read(v).step > 10]
    assert [v.step for v in new] == [15, 20, 24]
    for v in new:
        assert not any(n.startswith("rng/") for n in v.array_names())
        assert set(v.records["rng"]["packed"]) == {"torch", "numpy"}
        like = ref_versions[v.step]
        assert v.records["rng"] == like.records["rng"]
        assert _model_checksums(resumed, v.version) == _model_checksums(ref, like.version)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


TRAIN = ["train", "--steps", "12", "--checkpoint-every", "4", "--quiet"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The built-in mlp job run to its end: packed versions at steps 4, 8 and 12."""
    folder = tmp_path_factory.mktemp("packed")
    key = folder / "noise.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    done = _cli(*TRAIN, "--store", str(folder / "s.zarr"), "--key-file", str(key))
    assert done.returncode == 0, done.stderr
    return folder / "s.zarr", key


@pytest.fixture
def crashed(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """The same job as if it had died after version 2 (step 8)."""
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    (store / manifest_path(3)).unlink()
    return store, finished[1]


def test_a_forged_bit_of_the_packed_state_is_refused_by_resume_audit_and_export(
    crashed: tuple[Path, Path], tmp_path: Path
) -> None:
    store, key = crashed
    assert "packed" in Store.open(str(store), create=False).read(2).records["rng"]
    forge_manifest(Store.open(str(store), create=False), 2, _flip_packed_byte, keep_macs=True)
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "version 2 of" in line and "record 'rng'" in line and "fails its MAC" in line
    assert tree(store) == before
    audit = _cli("audit", str(store), "--key-file", str(key))
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert "FINDING [authentication] (version 2)" in audit.stdout
    assert "record 'rng'" in audit.stdout
    out = tmp_path / "model.pt"
    refused = _cli("export", str(store), "--out", str(out), "--key-file", str(key))
    assert refused.returncode == 1 and "record 'rng'" in refused.stderr, refused.stderr
    assert not out.exists()
    assert tree(store) == before


def test_a_damaged_bit_of_the_packed_state_is_named_by_inspect(
    crashed: tuple[Path, Path],
) -> None:
    store, _ = crashed
    path = store / manifest_path(2)
    doc = json.loads(path.read_bytes())
    _flip_packed_byte(doc)
    path.write_bytes(json.dumps(doc, sort_keys=True, indent=1).encode())
    run = _cli("inspect", str(store), "--version", "2")
    assert run.returncode != 0, run.stdout
    assert "record 'rng'" in run.stderr or "record 'rng'" in run.stdout, run.stderr


def test_inspect_counts_the_packed_states_as_the_rng_bytes_each_version_writes(
    finished: tuple[Path, Path],
) -> None:
    run = _cli("inspect", str(finished[0]), "--json")
    assert run.returncode == 0, run.stderr
    versions = json.loads(run.stdout)["versions"]
    assert len(versions) == 3
    for v in versions:  # torch's 5,056 bytes and numpy's 624 words, as the arrays were
        assert v["bytes_written_by_kind"]["rng"] == v["bytes_total_by_kind"]["rng"] == 7552


def test_audit_finds_an_oversized_packed_state_the_keys_holder_sealed(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    path = store / manifest_path(3)
    doc = json.loads(path.read_bytes())
    doc["records"]["rng"]["packed"]["numpy"]["shape"] = [1 << 15]  # 128 KiB of uint32
    path.write_bytes(reseal(doc, finished[1]))
    audit = _cli("audit", str(store), "--key-file", str(finished[1]))
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert "the rng record's packed numpy state: a packed array of 131072 bytes" in audit.stdout
    clean = _cli("audit", str(finished[0]), "--key-file", str(finished[1]))
    assert clean.returncode == 0, clean.stdout + clean.stderr


if __name__ == "__main__":  # regenerate: python -m tests.cocoon_ckpt.test_packed_state DIR
    write_packed_golden(Path(sys.argv[1]))
