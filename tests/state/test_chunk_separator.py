"""Format 3 stores chunks as `c.0.0` beside zarr.json (no `c/0/` folders) and records the
separator in the manifest; a format-2 store (`c/0/0`) still reads, audits and resumes to
the same bits."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cocoon_ckpt import ResumeAllowances, run_job
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.train.options import JobOptions
from state import CorruptVersionError, Store, restamp
from state.manifest import FORMAT_VERSION, ArrayMeta, Manifest

from ..cocoon_ckpt.conftest import job_config


def _job() -> object:
    return job_config("mlp", bands=4, steps=16, keep_last=5)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A 16-step job run whole, and the same job (same key) stopped at step 15."""
    root = tmp_path_factory.mktemp("sep")
    key = str(root / "k")
    whole, stopped = root / "whole.zarr", root / "stopped.zarr"
    run_job(_job(), str(whole), options=JobOptions(key_file=key))  # type: ignore[arg-type]
    run_job(_job(), str(stopped), stop_after=15, options=JobOptions(key_file=key))  # type: ignore[arg-type]
    return whole, stopped, key


def _to_format_2(root: Path) -> int:
    """Rewrite a store as format 2 wrote it: every chunk `c.i.j` moved to `c/i/j`, the
    arrays' zarr.json saying "/", the manifests of format 2 without the separator (their
    checksums recomputed, as that writer computed them). Returns the chunks moved."""
    moved = 0
    for path in sorted((root / "manifests").glob("*.json")):
        doc = json.loads(path.read_bytes())
        for entry in doc["arrays"].values():
            entry.pop("chunk_key_separator", None)
            folder = root / entry["path"]
            meta_file = folder / "zarr.json"
            meta = json.loads(meta_file.read_bytes())
            meta["chunk_key_encoding"]["configuration"]["separator"] = "/"
            meta_file.write_text(json.dumps(meta))
            for chunk in list(folder.glob("c.*")):
                target = folder.joinpath(*chunk.name.split("."))
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(chunk, target)
                moved += 1
        doc["format_version"] = 2
        path.write_bytes(restamp(doc))
    return moved


def _last_arrays(url: Path) -> dict[str, bytes]:
    store = Store.open(str(url))
    version = store.latest()
    return {name: version.array(name).tobytes() for name in version.array_names()}


def test_new_arrays_keep_their_chunks_beside_zarr_json(stores: tuple[Path, Path, str]) -> None:
    whole = stores[0]
    store = Store.open(str(whole))
    man = store.manifest(store.versions()[-1])
    assert man.format_version == FORMAT_VERSION == 4
    own = [m for m in man.arrays.values() if m.path.startswith("versions/")]
    assert own and all(m.separator == "." for m in own)
    for meta in own:
        names = sorted(os.listdir(whole / meta.path))
        assert names[-1] == "zarr.json" and all(n.startswith("c.") for n in names[:-1])
        assert not (whole / meta.path / "c").exists()
        encoding = json.loads((whole / meta.path / "zarr.json").read_bytes())["chunk_key_encoding"]
        assert encoding == {"name": "default", "configuration": {"separator": "."}}
    doc = json.loads((whole / "manifests" / f"{man.version:08d}.json").read_bytes())
    assert {e.get("chunk_key_separator") for e in doc["arrays"].values()} == {"."}


def test_a_format_2_store_reads_audits_and_resumes_to_the_same_bits(
    stores: tuple[Path, Path, str], tmp_path: Path
) -> None:
    whole, stopped, key = stores
    old = tmp_path / "old.zarr"
    shutil.copytree(stopped, old, symlinks=True)
    before = _last_arrays(old)
    assert _to_format_2(old) > 0
    store = Store.open(str(old))
    for v in store.versions():
        man = store.manifest(v)
        assert man.format_version == 2
        assert all(m.separator == "/" for m in man.arrays.values())
    assert _last_arrays(old) == before  # read through `c/i/j` now
    report = audit_store(str(old), coordinates=8, seed=0, key_file=key)
    # format 2 carried no MACs: the audit says so of each version, and of nothing else
    unauthenticated = {f.version for f in report.findings if f.check == "authentication"}
    assert unauthenticated == set(store.versions()), report.text()
    assert len(report.findings) == len(unauthenticated), report.text()
    allow = ResumeAllowances(unauthenticated=True)
    run_job(_job(), str(old), options=JobOptions(key_file=key, allow=allow))  # type: ignore[arg-type]
    assert _last_arrays(old) == _last_arrays(whole)
    resumed = Store.open(str(old))
    newest = resumed.manifest(resumed.versions()[-1])
    assert newest.format_version == 4 and newest.sealed
    # step 16 borrows the ring slots of steps 12-14 from the format-2 version of step 15
    ring = {m.separator for n, m in newest.arrays.items() if n.startswith("ring/")}
    assert ring == {"/", "."}
    report = audit_store(str(old), coordinates=8, seed=0, key_file=key)
    older = {f.version for f in report.findings if f.check == "authentication"}
    assert older == set(resumed.versions()) - {newest.version}, report.text()
    assert len(report.findings) == len(older), report.text()


def test_a_format_2_chunk_that_is_damaged_is_still_found(
    stores: tuple[Path, Path, str], tmp_path: Path
) -> None:
    old = tmp_path / "old.zarr"
    shutil.copytree(stores[1], old, symlinks=True)
    _to_format_2(old)
    store = Store.open(str(old))
    man = store.manifest(store.versions()[-1])
    meta = next(m for m in man.arrays.values() if m.path.startswith("versions/") and m.nbytes)
    chunk = next(p for p in (old / meta.path).rglob("*") if p.is_file() and p.name != "zarr.json")
    assert "c" in chunk.relative_to(old / meta.path).parts[0]
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptVersionError, match="checksum|crc32c"):
        store.read(man.version)


def test_a_separator_other_than_slash_or_dot_is_refused() -> None:
    entry = {"path": "versions/x/a", "shape": [2], "dtype": "float32", "checksum": "crc32c:0"}
    assert ArrayMeta.from_json(entry).separator == "/"
    assert ArrayMeta.from_json({**entry, "chunk_key_separator": "."}).separator == "."
    with pytest.raises(ValueError, match="chunk_key_separator '-'"):
        ArrayMeta.from_json({**entry, "chunk_key_separator": "-"})
    meta = ArrayMeta(path="versions/x/a", shape=(2,), dtype="float32", checksum="crc32c:0")
    assert "chunk_key_separator" not in meta.to_json()  # format 2's entry, byte for byte


def test_a_checksummed_manifest_claiming_format_1_is_corrupt(
    stores: tuple[Path, Path, str], tmp_path: Path
) -> None:
    url = tmp_path / "s.zarr"
    shutil.copytree(stores[1], url, symlinks=True)
    path = sorted((url / "manifests").glob("*.json"))[-1]
    doc = json.loads(path.read_bytes())
    doc["format_version"] = 1
    path.write_bytes(restamp(doc))
    with pytest.raises(CorruptVersionError, match="claims format 1"):
        Manifest.from_bytes(path.read_bytes(), version=doc["version"], where=str(url))
