"""audit and export of a store whose CSC the tools stream (`tools.csc_reads`): the same
report and the same exported bytes as the whole-CSC path, a peak that a window bounds
(traced by tracemalloc, numpy reports its buffers to it), never the CSC, and a damaged
or forged CSC found as before, with the same exit codes."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import state.arrays
from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.embedding import csc_window
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.csc_window import CscWindows
from cocoon_ckpt.tools import csc_reads
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.audit import embedding as audit_embedding
from cocoon_ckpt.tools.export import export_model
from cocoon_ckpt.train.options import JobOptions
from state import Store, Version, array_checksum

from .conftest import reseal, tree

PARAM = "tables.0.weight"
CSC = f"emb/{PARAM}/csc"
#: Chunks of 16 KiB: the CSC's values lie in some 90 chunk files, its windows cross them.
CHUNK = 16 << 10
JOB = "example:dlrm"


def _config(window: int | None) -> JobConfig:
    # flat ids over 2,000 rows of dim 128: most reads are cold, so the CSC (~1.4 MB, every
    # step's cold reads and a tail per cold row) is many windows of 3 steps
    return JobConfig(
        job=JOB,
        dp=DPConfig(steps=32, batch_size=64, dataset_size=1024, noise_multiplier=1.0, bands=4),
        options={"tables": [2000, 300], "dim": 128, "dense": 4, "zipf": 0.5},
        checkpoint_every=12,
        async_checkpoint=False,
        lr=0.5,
        embedding=EmbeddingConfig(
            mode=TableMode("coalesced"),
            threat_model="final_model",
            hot_threshold=3,
            csc_window_steps=window,
        ),
    )


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same job (one key file) run holding its CSC whole and reading it in windows
    of 3 steps; `key` is the key file."""
    root = tmp_path_factory.mktemp("csc-stream")
    key = root / "noise.key"
    out = {"key": key}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(state.arrays, "CHUNK_BYTES", CHUNK)
        for name, window in (("whole", None), ("windowed", 3)):
            run_job(_config(window), str(root / name), options=JobOptions(key_file=str(key)))
            out[name] = root / name
    return out


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tails read in pieces no larger than the largest step window (not 4,096
    entries, the whole tails of this small table)."""
    monkeypatch.setattr(csc_window, "TAIL_PIECE_MIN", 8)


def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tools read every CSC whole, as before they streamed it."""
    monkeypatch.setattr(csc_reads, "window_steps", lambda manifest, param: None)


def _audit(store: Path, key: Path) -> dict[str, Any]:
    report = audit_store(str(store), coordinates=32, seed=7, key_file=str(key), job=JOB)
    doc = dataclasses.asdict(report)
    doc.pop("store")
    return doc


def _export(store: Path, key: Path, out: Path) -> tuple[bytes, dict[str, Any]]:
    export_model(str(store), str(out), key_file=str(key))
    report = json.loads(Path(f"{out}.privacy.json").read_text())
    report["source"].pop("store")
    return out.read_bytes(), report


class _Reads:
    """Which CSC arrays the tools read whole (`Version.array`), and the windowed
    readers they opened."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.whole: list[str] = []
        self.windows: list[CscWindows] = []
        array, opened = Version.array, CscWindows.__init__

        def spy_array(version: Version, name: str) -> Any:
            if csc_reads.csc_part(name) is not None:
                self.whole.append(name)
            return array(version, name)

        def spy_open(windows: CscWindows, *args: Any, **kw: Any) -> None:
            opened(windows, *args, **kw)
            self.windows.append(windows)

        monkeypatch.setattr(Version, "array", spy_array)
        monkeypatch.setattr(CscWindows, "__init__", spy_open)


def test_a_windowed_store_audits_and_exports_as_the_whole_one(
    jobs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job read in windows of 3 steps is audited in windows of 3 (its own), its CSC
    verified chunk by chunk and never read whole: the report is the whole-CSC job's
    (same key, same seed: the same cold rows recomputed, bit for bit), and so is the
    exported model, byte for byte; the same store read whole by the tools says the
    same again."""
    key = jobs["key"]
    reads = _Reads(monkeypatch)
    got = _audit(jobs["windowed"], key)
    assert not reads.whole and {w.window_steps for w in reads.windows} == {3}
    assert all(w.windows_read >= 32 // 3 for w in reads.windows)
    assert got["findings"] == [] and got["skipped"] == []
    emb = got["checks"]["embedding"]
    assert emb["entries_recomputed"] == emb["bit_identical"] > 0
    assert emb["online_slots"] == emb["online_slots_bit_identical"] > 0
    model, report = _export(jobs["windowed"], key, tmp_path / "windowed.pt")
    assert not reads.whole
    opened = len(reads.windows)

    whole_store = _audit(jobs["whole"], key)
    assert len(reads.windows) == opened and reads.whole  # the whole job's CSC: read whole
    # the windowed job's store holds a few more files (its CSC assembled on disk)
    assert got["checks"].pop("permissions") != whole_store["checks"].pop("permissions")
    assert got == whole_store
    assert (model, report) == _export(jobs["whole"], key, tmp_path / "whole.pt")
    # the same windowed store, the tools told to read it whole
    _whole(monkeypatch)
    again = _audit(jobs["windowed"], key)
    assert again["checks"].pop("permissions") and again == got
    assert (model, report) == _export(jobs["windowed"], key, tmp_path / "read-whole.pt")


def test_a_large_csc_of_a_job_that_held_it_whole_is_streamed(
    jobs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `WHOLE_BYTES` the tools stream the CSC of a job that held it whole, in
    windows of about `WINDOW_BYTES`: the report is the one a whole read gives."""
    key = jobs["key"]
    want = _audit(jobs["whole"], key)
    monkeypatch.setattr(csc_reads, "WHOLE_BYTES", 0)
    monkeypatch.setattr(csc_reads, "WINDOW_BYTES", 100 << 10)
    reads = _Reads(monkeypatch)
    assert _audit(jobs["whole"], key) == want
    assert not reads.whole and reads.windows
    for w in reads.windows:  # the mean column (the tails one of them) into 100 KiB
        assert w.window_steps == (100 << 10) * (w.col_ptr.size - 1) // w.nbytes, w.stored.param
    assert max(w.window_steps for w in reads.windows) > 1


def _traced(run: Callable[[], Any]) -> int:
    """The traced peak above the start of `run`."""
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[1] - start
    finally:
        tracemalloc.stop()


@pytest.mark.usefixtures("small_pieces")
def test_the_peak_is_a_window_not_the_csc(
    jobs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tracemalloc over the audit's walk of the CSC (its columns against the schedule,
    the picked rows' entries gathered), over each CSC array's verification, and over
    the whole audit and export: streamed, the walk holds two windows at most and a
    verification a chunk or two, a fraction of the CSC; read whole, each holds the CSC,
    which the whole audit and export then hold on top of everything else."""
    store, key = jobs["windowed"], jobs["key"]
    metas = Store.open(str(store), create=False).latest(verify=False).manifest.arrays  # type: ignore[union-attr]
    csc = metas[f"{CSC}/rows"].nbytes + metas[f"{CSC}/values"].nbytes
    assert csc > 40 * CHUNK  # tens of chunks, and of windows

    walk, verify = audit_embedding._walk_csc, csc_reads.verify_array
    peaks: dict[str, list[int]] = {"walk": [], "verify": []}

    def traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            try:
                return fn(*args)
            finally:
                if name == "walk" or csc_reads.csc_part(args[1]) == (PARAM, "values"):
                    peaks[name].append(tracemalloc.get_traced_memory()[1] - start)

        return run

    def measured(read_whole: bool) -> tuple[int, int, int, int]:
        with monkeypatch.context() as mp:
            if read_whole:
                _whole(mp)
            reads = _Reads(mp)
            for k in peaks:
                peaks[k].clear()
            mp.setattr(audit_embedding, "_walk_csc", traced("walk", walk))
            mp.setattr(csc_reads, "verify_array", traced("verify", verify))
            _traced(lambda: _audit(store, key))
            parts = max(peaks["walk"]), max(peaks["verify"])
            if not read_whole:
                (windows,) = [w for w in reads.windows if w.stored.param == PARAM]
                assert windows.peak_resident_bytes <= 2 * windows.max_window_bytes() < csc / 8
        audit = _traced(lambda: _audit(store, key))
        out = tmp_path / f"m-{read_whole}.pt"
        export = _traced(lambda: export_model(str(store), str(out), key_file=str(key)))
        return (*parts, audit, export)

    _audit(store, key)  # what a first audit in a process allocates once, not measured
    walk_s, verify_s, audit_s, export_s = measured(read_whole=False)
    with monkeypatch.context() as mp:
        _whole(mp)
        walk_w, verify_w, audit_w, export_w = measured(read_whole=True)
    # streamed: two windows and the picked rows' entries; a chunk and its checks
    assert walk_s < csc / 4, (walk_s, csc)
    assert verify_s < 12 * CHUNK < csc / 6, (verify_s, csc)
    # whole: the CSC itself (the walk holds the three arrays)
    assert walk_w >= csc and verify_w >= metas[f"{CSC}/values"].nbytes, (walk_w, verify_w)
    # whole runs hold the CSC on top of what both hold
    assert audit_w - audit_s >= 0.75 * csc, (audit_w, audit_s, csc)
    assert export_w - export_s >= 0.75 * csc, (export_w, export_s, csc)


def _copy(jobs: dict[str, Path], tmp_path: Path) -> Path:
    dst = tmp_path / "s.zarr"
    shutil.copytree(jobs["windowed"], dst, symlinks=True)
    return dst


def _newest(root: Path) -> dict[str, Any]:
    return dict(json.loads(sorted((root / "manifests").glob("*.json"))[-1].read_text()))


def _chunks(root: Path, path: str) -> Iterator[Path]:
    return (p for p in sorted((root / path).iterdir()) if p.name.startswith("c"))


@pytest.mark.parametrize("read_whole", [False, True])
def test_a_damaged_byte_is_reported(
    jobs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    read_whole: bool,
) -> None:
    """One flipped byte in a chunk of the CSC's values: audit names the array, as a
    failed checksum, and its embedding check cannot use the CSC (exit 1); export
    refuses the version, naming the array (exit 1), and writes nothing; streamed or
    whole."""
    if read_whole:
        _whole(monkeypatch)
    root, key = _copy(jobs, tmp_path), jobs["key"]
    path = _newest(root)["arrays"][f"{CSC}/values"]["path"]
    chunk = list(_chunks(root, path))[5]
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x10
    chunk.write_bytes(bytes(data))
    before = tree(root)

    report = audit_store(str(root), coordinates=16, seed=7, key_file=str(key), job=JOB)
    found = {(f.check, f.version) for f in report.findings}
    newest = _newest(root)["version"]
    assert ("checksums", newest) in found and ("embedding", None) in found, report.text()
    sums = [f.message for f in report.findings if f.check == "checksums"]
    assert all(path in m for m in sums) and len(sums) == len(os.listdir(root / "manifests"))
    args = ["--key-file", str(key), str(root)]
    assert main(["audit", "--seed", "7", "--example", "dlrm", *args]) == 1
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", "--out", str(out / "m.pt"), *args]) == 1
    err = capsys.readouterr().err
    assert path in err and f"version {newest}" in err, err
    assert not list(out.iterdir()) and tree(root) == before


@pytest.mark.parametrize("read_whole", [False, True])
def test_a_missing_chunk_is_a_damaged_version(
    jobs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    read_whole: bool,
) -> None:
    """A chunk file of the CSC's values gone: export refuses the version as damaged,
    naming the array (exit 1), streamed or whole, never a bare file error."""
    if read_whole:
        _whole(monkeypatch)
    root, key = _copy(jobs, tmp_path), jobs["key"]
    path = _newest(root)["arrays"][f"{CSC}/values"]["path"]
    list(_chunks(root, path))[3].unlink()
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export", "--out", str(out / "m.pt"), "--key-file", str(key), str(root)]) == 1
    err = capsys.readouterr().err
    assert path in err and "missing or torn" in err, err
    assert not list(out.iterdir())


def test_a_forged_csc_with_valid_checksums_is_found_in_windows(
    jobs: dict[str, Path], tmp_path: Path
) -> None:
    """The CSC's values scaled by 1.001 and every checksum re-stamped under the key
    (what only its holder could store): every chunk verifies, so only the cold rows'
    entries recomputed from the key, walked window by window, can tell."""
    root, key = _copy(jobs, tmp_path), jobs["key"]
    path = _newest(root)["arrays"][f"{CSC}/values"]["path"]
    arr = zarr.open_array(str(root / path), mode="r+")
    forged = (arr[...] * np.float32(1.001)).astype(arr.dtype)
    arr[...] = forged  # the chunk grid kept, each chunk with a valid crc32c
    for p in sorted((root / "manifests").glob("*.json")):
        doc = json.loads(p.read_text())
        for meta in doc["arrays"].values():
            if meta["path"] == path:
                meta["checksum"] = array_checksum(forged)
        p.write_bytes(reseal(doc, key))
    report = audit_store(str(root), coordinates=16, seed=7, key_file=str(key), job=JOB)
    found = [f.message for f in report.findings]
    assert not [f for f in report.findings if f.check == "checksums"], found
    assert any(f"table {PARAM}" in m and "differ from the stored CSC" in m for m in found), found
