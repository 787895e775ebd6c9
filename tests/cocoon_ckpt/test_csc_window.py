"""A committed CSC read from the store in windows of steps (`EmbeddingConfig.
csc_window_steps`): every column is the whole CSC's, bit for bit, for any window; at
most two windows are in memory (counted, and traced by tracemalloc); a byte changed in
the store is caught before it is used; a job trained with windows ends on the same
model as one holding the whole CSC, through stops and resumes, and where the dense
mechanism ends (I5)."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import state.arrays
from cocoon_ckpt import BandMF, DPConfig, JobConfig, run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.embedding import (
    AccessSchedule,
    CoalescedCSC,
    csc_assembly,
    csc_window,
    precompute_csc,
    table_noise,
)
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.csc_assembly import CscAssembly
from cocoon_ckpt.embedding.csc_window import CSC_PARTS, CscWindows, StoredCSC
from cocoon_ckpt.embedding.precompute import AFTER_TILE, TileEntries, precompute_into
from cocoon_ckpt.embedding.stored_tiles import StoredTiles
from cocoon_ckpt.examples.dlrm import zipf_ids
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.layout import emb_name
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, crash_at, disarm_all
from state import CorruptVersionError, Store, StoreError

KEY = bytes(range(32))
ROWS, STEPS, DIM = 400, 80, 4
PARAM = "emb.weight"


HOT = 3


def _case(
    rows: int = ROWS, steps: int = STEPS, dim: int = DIM, reads: int = 24
) -> tuple[AccessSchedule, dict[str, Any]]:
    """A table's schedule, and the rest of what its precompute takes."""
    rng = np.random.default_rng(5)
    sched = AccessSchedule.from_step_rows(
        rows, [zipf_ids(rows, reads, 1.1, rng) for _ in range(steps)]
    )
    noise = table_noise(KEY, PARAM, rows, dim, 0.7, torch.float32)
    args = {
        "schedule": sched, "order": sched.noise_order(), "hot": HOT, "dim": dim,
        "mechanism": BandMF.banded_sqrt(4, steps), "noise": noise,
        "factors": np.full(steps, 0.02),
    }  # fmt: skip
    return sched, args


def _csc(rows: int = ROWS, steps: int = STEPS, dim: int = DIM, reads: int = 24) -> CoalescedCSC:
    _, args = _case(rows, steps, dim, reads)
    return precompute_csc(**args, tile_rows=256, threads=1)


def _commit(root: Path, csc: CoalescedCSC) -> StoredCSC:
    """`csc` as a job's first version holds it: shared arrays, referenced."""
    store = Store.open(str(root))
    store.acquire_lease()
    txn = store.begin(1)
    for k, arr in csc.arrays().items():
        txn.reference(emb_name(PARAM, f"csc/{k}"), store.put_shared(f"t/{k}", arr))
    txn.commit()
    version = store.latest()
    assert version is not None
    return StoredCSC.of_version(version, PARAM)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1 KiB: every window crosses chunk files, and windows start mid-chunk."""
    monkeypatch.setattr(state.arrays, "CHUNK_BYTES", 1 << 10)


def _columns(src: CoalescedCSC | CscWindows, order: list[int]) -> list[tuple[bytes, bytes]]:
    out = []
    for t in order:
        rows, vals = src.column(t)
        out.append((rows.tobytes(), vals.tobytes()))
    return out


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("window", [1, 4, 7, STEPS + 1, 1000])
@pytest.mark.parametrize("like", [False, True])
def test_every_column_is_the_whole_cscs(tmp_path: Path, window: int, like: bool) -> None:
    csc = _csc()
    stored = _commit(tmp_path / "s.zarr", csc)
    assert state.arrays.CHUNK_BYTES == 1 << 10 and stored.metas["values"].chunks != (csc.nnz, DIM)
    windows = CscWindows(stored, window, like=csc if like else None)
    try:
        steps = list(range(STEPS + 1))
        assert _columns(windows, steps) == _columns(csc, steps)
        # each read once, in order: the steps' windows, then the tails' pieces
        assert windows.windows_read == windows.windows >= -(-STEPS // window) + 1
        # out of order (a resume mid-window, a re-read) is answered too
        jumbled = [17, 3, 3, STEPS, 0, 29, 18, STEPS - 1]
        assert _columns(windows, jumbled) == _columns(csc, jumbled)
        assert windows.nnz == csc.nnz and windows.nbytes == csc.nbytes
        assert windows.peak_resident_bytes <= 2 * windows.max_window_bytes()
    finally:
        windows.close()
    assert windows.resident_bytes == 0


@pytest.mark.usefixtures("small_chunks")
def test_windows_of_an_object_store_are_ranged_reads() -> None:
    """On fsspec storage (memory:// here, as s3:// would be) a window reads its byte
    ranges of the chunks, checked as on local disk."""
    csc = _csc()
    url = f"memory://csc-window-{secrets.token_hex(4)}"
    store = Store.open(url)
    store.acquire_lease()
    txn = store.begin(1)
    for k, arr in csc.arrays().items():
        txn.reference(emb_name(PARAM, f"csc/{k}"), store.put_shared(f"t/{k}", arr))
    txn.commit()
    version = store.latest()
    assert version is not None and not store.backend.local
    windows = CscWindows(StoredCSC.of_version(version, PARAM), 3)
    steps = list(range(STEPS + 1))
    assert _columns(windows, steps) == _columns(csc, steps)
    windows.close()


@pytest.mark.usefixtures("small_chunks")
def test_the_resident_csc_stays_bounded(tmp_path: Path) -> None:
    """Two windows at most, by the reader's own count and by tracemalloc (numpy reports
    its buffers to it) over a whole pass of the steps, the open's verification pass
    included: a fraction of the CSC, which is never held whole."""
    steps = 400
    csc = _csc(rows=1000, steps=steps, dim=16, reads=64)
    stored = _commit(tmp_path / "s.zarr", csc)
    total = csc.rows.nbytes + csc.values.nbytes
    del csc
    tracemalloc.start()
    try:
        windows = CscWindows(stored, 4)
        for t in range(steps + 1):
            rows, vals = windows.column(t)
            assert rows.size == vals.shape[0]
        del rows, vals
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the largest window is the tails' (a column of every cold row)
    bound = 2 * windows.max_window_bytes()
    assert windows.peak_resident_bytes <= bound < total / 5
    # besides the windows: a chunk or two in flight, the column pointer, the window
    # crcs and the prefetch thread's own objects
    assert peak < total / 4, (peak, bound, total)
    windows.close()


@pytest.mark.usefixtures("small_chunks")
def test_the_tails_are_read_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Column n holds every cold row: it is read in pieces no larger than the largest
    window, which applied in turn give the table the whole column gives it."""
    monkeypatch.setattr(csc_window, "TAIL_PIECE_MIN", 8)
    csc = _csc()
    windows = CscWindows(_commit(tmp_path / "s.zarr", csc), 2)
    pieces = list(windows.tail_pieces())
    largest = max(int(np.diff(csc.col_ptr[: STEPS + 1]).reshape(-1, 2).sum(axis=1).max()), 8)
    assert len(pieces) == -(-(ROWS - HOT) // largest) > 1
    rows, vals = csc.column(STEPS)
    assert b"".join(p[0].tobytes() for p in pieces) == rows.tobytes()
    assert b"".join(p[1].tobytes() for p in pieces) == vals.tobytes()
    assert windows.column(STEPS)[1].tobytes() == vals.tobytes()  # gathered whole on request
    assert windows.peak_resident_bytes <= 2 * windows.max_window_bytes()
    windows.close()


def test_a_byte_changed_in_the_store_is_caught_before_use(tmp_path: Path) -> None:
    csc = _csc()
    root = tmp_path / "s.zarr"
    stored = _commit(root, csc)
    chunk = next(p for p in (root / stored.metas["values"].path).rglob("c*") if p.is_file())
    good = chunk.read_bytes()
    # after the open: the window holding it fails its crc, in the step that needs it
    windows = CscWindows(stored, 5)
    windows.column(0)
    data = bytearray(good)
    data[-5] ^= 1  # the last value: the tails' window, read after the change
    # replaced whole (never seen torn), as the next window may be read meanwhile
    (tmp_path / "damaged").write_bytes(bytes(data))
    os.replace(tmp_path / "damaged", chunk)
    with pytest.raises(CorruptVersionError, match="changed since it was verified"):
        for t in range(1, STEPS + 1):
            windows.column(t)
    windows.close()
    # before the open: the chunk's crc32c
    with pytest.raises(CorruptVersionError, match="crc32c"):
        CscWindows(stored, 5)
    # a chunk re-stamped with a right crc32c still fails the manifest's checksum
    import crc32c

    body = bytes(data[:-4])
    chunk.write_bytes(body + crc32c.crc32c(body).to_bytes(4, "little"))
    with pytest.raises(CorruptVersionError, match="fails its checksum"):
        CscWindows(stored, 5)
    # and a CSC in memory that is not the committed one is refused as its reference
    chunk.write_bytes(good)
    other = CoalescedCSC(csc.col_ptr, csc.rows, csc.values + np.float32(1))
    with pytest.raises(CorruptVersionError, match="not the one this job computed"):
        CscWindows(stored, 5, like=other)


def _assemble(
    store: Store,
    window: int,
    tile_rows: int,
    threads: int = 2,
    case: tuple[AccessSchedule, dict[str, Any]] | None = None,
) -> tuple[StoredCSC, dict[str, list[int]], CscAssembly]:
    sched, args = case or _case()
    assembly = CscAssembly(
        store, PARAM, sched, args["order"], HOT, args["dim"], np.dtype(np.float32), window
    )
    try:
        precompute_into(assembly.add, **args, tile_rows=tile_rows, threads=threads)
        stored, crcs = assembly.finish()
    finally:
        assembly.close()
    return stored, crcs, assembly


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("window", [1, 6, 1000])
def test_a_csc_assembled_in_the_store_is_the_in_memory_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """Tiles spilled by bucket (a bucket per window here), sorted bucket by bucket and
    streamed into the store: the same bytes as the CSC built in memory, and the window
    crcs it hands over are those a verification pass of the store finds."""
    monkeypatch.setattr(csc_assembly, "MIN_BUCKET_BYTES", 1)
    whole = _csc()
    root = tmp_path / "s.zarr"
    store = Store.open(str(root))
    store.acquire_lease()
    stored, crcs, assembly = _assemble(store, window, tile_rows=37)
    assert stored.version is None and not Path(assembly.spill).exists()
    assert stored.metas["values"].chunks is not None
    assert stored.metas["values"].chunks[0] < whole.nnz  # streamed over several chunks
    # a bucket per window of steps, then the tails in runs no larger than those
    regular = -(-STEPS // window)
    assert assembly.buckets > regular + (window < STEPS)  # the tails split in runs too
    txn = store.begin(1)
    for k, meta in stored.metas.items():
        txn.reference(emb_name(PARAM, f"csc/{k}"), meta)
    txn.commit()
    version = store.latest()
    assert version is not None
    for k, arr in whole.arrays().items():
        got = version.array(emb_name(PARAM, f"csc/{k}"))  # checked against its checksum
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes(), k
    committed = StoredCSC.of_version(version, PARAM)
    verified = CscWindows(committed, window)
    assert verified._crcs == crcs
    handed = CscWindows(stored, window, crcs=crcs)
    steps = list(range(STEPS + 1))
    assert _columns(handed, steps) == _columns(whole, steps)
    verified.close()
    handed.close()


def test_the_assembly_never_holds_the_csc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tracemalloc over the whole precompute (tiles of 32 rows, windows of 4 steps,
    buckets of 256 KiB), above what computing the tiles alone takes (the fresh noise's
    own buffers): into the store, a bucket and its sorted copy, under half the CSC; in
    memory, the entries and the CSC sorted from them, over twice the CSC."""
    monkeypatch.setattr(csc_assembly, "MIN_BUCKET_BYTES", 256 << 10)
    # chunks of 64 KiB: the store keeps a few hundred bytes per file until its fsync,
    # which at 1 KiB chunks would outweigh the buckets (at 16 MiB it is nothing)
    monkeypatch.setattr(state.arrays, "CHUNK_BYTES", 64 << 10)
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    case = _case(rows=2000, steps=160, dim=16, reads=1024)
    args = case[1]
    precompute_into(lambda _: None, **args, tile_rows=32, threads=1)  # one-time set-ups
    peaks = {}
    for run in ("tiles alone", "store", "memory"):
        tracemalloc.start()
        try:
            if run == "tiles alone":
                precompute_into(lambda _: None, **args, tile_rows=32, threads=1)
            elif run == "store":
                stored, _, assembly = _assemble(store, 4, tile_rows=32, threads=1, case=case)
            else:
                precompute_csc(**args, tile_rows=32, threads=1)
            peaks[run] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    total = stored.nbytes
    assert assembly.spilled_bytes > total
    assert peaks["store"] - peaks["tiles alone"] < total / 2, (peaks, total)
    assert peaks["memory"] - peaks["tiles alone"] > 2 * total, (peaks, total)


@pytest.mark.usefixtures("small_chunks")
def test_an_assembly_resumed_from_kept_tiles_is_the_same_bytes(tmp_path: Path) -> None:
    """A precompute into the store stopped at its 4th tile (its tiles kept): the next
    one loads those, hands them to the assembly one at a time with the computed rest,
    and the CSC is the in-memory one."""
    whole = _csc()
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    sched, args = _case()
    crash_at(AFTER_TILE, step=4)
    try:
        with pytest.raises(CrashPointHit):
            first = CscAssembly(
                store, PARAM, sched, args["order"], HOT, DIM, np.dtype(np.float32), 3
            )
            try:
                parts = StoredTiles(store, PARAM, "d" * 32, mac_key=KEY)
                precompute_into(first.add, **args, tile_rows=40, threads=1, parts=parts)
            finally:
                first.close()
    finally:
        disarm_all()
    again = CscAssembly(store, PARAM, sched, args["order"], HOT, DIM, np.dtype(np.float32), 3)
    parts = StoredTiles(store, PARAM, "d" * 32, mac_key=KEY)
    precompute_into(again.add, **args, tile_rows=40, threads=2, parts=parts)
    stored, crcs = again.finish()
    again.close()
    assert (parts.loaded, parts.computed) == (4, -(-(ROWS - HOT) // 40) - 4)
    windows = CscWindows(stored, 3, crcs=crcs)
    steps = list(range(STEPS + 1))
    assert _columns(windows, steps) == _columns(whole, steps)
    windows.close()


def test_an_attempt_killed_before_the_first_version_leaves_no_second_csc(tmp_path: Path) -> None:
    """Under the precompute's digest, the next attempt's arrays replace the ones an
    attempt killed before the first version left (nothing references them yet)."""
    root = tmp_path / "s.zarr"
    store = Store.open(str(root))
    store.acquire_lease()
    sched, args = _case()
    for _ in range(2):
        assembly = CscAssembly(
            store, PARAM, sched, args["order"], HOT, DIM, np.dtype(np.float32), 5, "d" * 32
        )
        precompute_into(assembly.add, **args, tile_rows=64, threads=1)
        stored, crcs = assembly.finish()
        assembly.close()
    # beside the precompute's scratch (spills gone; deleted once a version holds the CSC)
    folders = {p.name for p in (root / "shared").iterdir() if p.is_dir()}
    assert folders == {f"csc-{'d' * 32}", "precompute"}
    assert not [p for p in (root / "shared" / "precompute").rglob("*") if p.is_file()]
    windows = CscWindows(stored, 5, crcs=crcs)
    steps = list(range(STEPS + 1))
    assert _columns(windows, steps) == _columns(_csc(), steps)
    windows.close()


def test_an_assembly_missing_a_tile_is_refused(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    sched, args = _case()
    assembly = CscAssembly(store, PARAM, sched, args["order"], HOT, DIM, np.dtype(np.float32), 5)
    seen: list[int] = []

    def all_but_the_second(entries: TileEntries) -> None:
        seen.append(1)
        if len(seen) != 2:
            assembly.add(entries)

    precompute_into(all_but_the_second, **args, tile_rows=64, threads=1)
    with pytest.raises(StoreError, match="coalesced entries, its schedule says"):
        assembly.finish()
    assembly.close()


def test_refusals_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="csc_window_steps=0"):
        EmbeddingConfig(mode="coalesced", threat_model="final_model", csc_window_steps=0)
    # a malformed request: exit 2, one line naming the flag and the fix, nothing written
    coalesced = ["--embedding", "coalesced", "--threat-model", "final_model"]
    for extra, says in (
        (["--csc-window-steps", "4"], "--csc-window-steps 4: .* give it with --embedding"),
        ([*coalesced, "--csc-window-steps", "0"], "csc_window_steps=0: give 1 or more"),
    ):
        store = tmp_path / "never.zarr"
        assert main(["train", "--example", "dlrm", "--store", str(store), *extra]) == 2
        assert re.search(says, capsys.readouterr().err)
        assert not store.exists()


# -- whole jobs ------------------------------------------------------------------------


def _config(window: int | None, mode: str = "coalesced", steps: int = 14) -> JobConfig:
    return JobConfig(
        job="example:dlrm",
        dp=DPConfig(steps=steps, batch_size=12, dataset_size=360, noise_multiplier=1.0, bands=4),
        options={"tables": [90, 40, 7], "dim": 3, "dense": 4, "dtype": "float64"},
        checkpoint_every=4,
        async_checkpoint=False,
        lr=0.5,
        embedding=EmbeddingConfig(
            mode=TableMode(mode),
            threat_model="final_model",
            hot_threshold=2,
            csc_window_steps=window,
        ),
    )


def _model(store: Path) -> dict[str, torch.Tensor]:
    version = Store.open(str(store), create=False).latest()
    assert version is not None
    return model_state(version)


def test_windowed_jobs_end_on_the_whole_cscs_model(tmp_path: Path) -> None:
    """A small DLRM job (float64, b = 4, 14 steps): windows of 1, 3 and more steps than
    the run give the whole-CSC model bit for bit, through stops and resumes that change
    the window (it is not fingerprinted), and the steps after the first version read
    the CSC from the store; and the final tables are the dense mechanism's (I5)."""
    opts = JobOptions(key_file=str(tmp_path / "k"))
    run_job(_config(None), str(tmp_path / "whole"), options=opts)
    want = _model(tmp_path / "whole")
    read: dict[int, int] = {}

    def count(window: int):  # type: ignore[no-untyped-def]
        def on_step(_: object, trainer: object) -> None:
            emb = trainer.embedding  # type: ignore[attr-defined]
            got = [e.csc for e in emb.engines if isinstance(e.csc, CscWindows)]
            read[window] = max(read.get(window, 0), sum(w.windows_read for w in got))

        return on_step

    for window in (1, 3, 100):
        store = str(tmp_path / f"w{window}")
        run_job(_config(window), store, options=opts, on_step=count(window), stop_after=6)
        run_job(_config(None), store, options=opts, stop_after=9)  # whole, in between
        run_job(_config(window), store, options=opts, on_step=count(window))
        got = _model(Path(store))
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want), window
    assert read[1] > read[3] > 0 and read[100] >= 1
    run_job(_config(None, mode="dense"), str(tmp_path / "dense"), options=opts)
    dense = _model(tmp_path / "dense")
    for k in dense:
        torch.testing.assert_close(want[k], dense[k], rtol=1e-12, atol=1e-12, msg=k)
    # every version references the one committed CSC
    store = Store.open(str(tmp_path / "w3"), create=False)
    paths = {
        store.manifest(v).arrays[emb_name("tables.0.weight", f"csc/{k}")].path
        for v in store.versions()
        for k in CSC_PARTS
    }
    assert len(paths) == len(CSC_PARTS)


# -- a real `cocoon-ckpt train`, SIGKILLed while it reads its CSC in windows -----------

_RESIDENT = re.compile(
    r"table (\S+): CSC of (\d+) bytes read in (\d+) windows of (\d+) steps, "
    r"at most (\d+) bytes resident"
)


def _train_args(store: Path, key: Path, window: int | None) -> list[str]:
    # every row cold (read at most 1000 times): ~8 entries a row against its one tail, so
    # the tails' window, the largest, is a fraction of the CSC
    return [
        *("--log-level", "INFO", "train", "--example", "dlrm"),
        *("--embedding", "coalesced", "--threat-model", "final_model", "--hot-threshold", "1000"),
        *("--job-option", "tables=[500,300]", "--store", str(store), "--key-file", str(key)),
        *("--steps", "64", "--checkpoint-every", "16", "--bands", "8", "--batch-size", "64"),
        *("--dataset-size", "1024", "--quiet"),
        *(("--csc-window-steps", str(window)) if window is not None else ()),
    ]


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )


def test_a_job_reading_windows_is_killed_and_resumed_bit_exact(tmp_path: Path) -> None:
    """The whole job with windows of 2 steps, SIGKILLed at step 37 (its CSC assembled
    in the store, a version or two committed), resumed with windows of 5: the exported model
    is the whole-CSC job's bit for bit (one key file), and the resumed process held at
    most a third of each table's CSC at once (its own count, logged), the budget this
    job's CSC exceeds."""
    key = tmp_path / "noise.key"
    gold, run = tmp_path / "gold.zarr", tmp_path / "run.zarr"
    whole = _cli(_train_args(gold, key, None))
    assert whole.returncode == 0, whole.stderr
    assert not _RESIDENT.search(whole.stderr)  # held whole: no windows
    killed = _cli(_train_args(run, key, 2), {"COCOON_CRASH_AT": "trainer.after_update:step=37"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # the background writer may not have committed step 32's version yet
    assert Store.open(str(run), create=False).latest().step in (16, 32)  # type: ignore[union-attr]
    resumed = _cli(_train_args(run, key, 5))
    assert resumed.returncode == 0, resumed.stderr
    held = {m.group(1): m for m in _RESIDENT.finditer(resumed.stderr)}
    assert set(held) == {"tables.0.weight", "tables.1.weight"}, resumed.stderr
    for m in held.values():
        csc_bytes, windows, steps, resident = (int(m.group(i)) for i in (2, 3, 4, 5))
        budget = csc_bytes // 3
        assert steps == 5 and windows >= (64 - 32) // 5 and 0 < resident <= budget
    models = {}
    for name, store in (("gold", gold), ("run", run)):
        out = tmp_path / f"{name}.pt"
        assert main(["export", str(store), "--key-file", str(key), "--out", str(out)]) == 0
        models[name] = torch.load(out)
    assert models["gold"].keys() == models["run"].keys()
    assert all(torch.equal(models["gold"][k], models["run"][k]) for k in models["gold"])
    audit = _cli(["audit", "--key-file", str(key), "--example", "dlrm", str(run)])
    assert audit.returncode == 0, audit.stdout + audit.stderr
