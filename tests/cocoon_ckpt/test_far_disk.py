"""A ring larger than host memory: the far tier backed by a file on local disk (#31).

The far shard is streamed, never mapped: the GEMV in column chunks equals the kernel over
the whole shard bit for bit, and neither the trainer nor the far worker holds the shard
in its resident memory. A host budget sends the rest of the ring to the far file with
the same noise bits as all on the host; a job on it resumes bit-exact after real
SIGKILLs, and the folders a killed owner leaves are swept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt import BandMF, BandMFNoise
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.gemv import mix_history
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.format.ring_rows import encode_slots, load_ring
from cocoon_ckpt.layout import ring_rows_name
from cocoon_ckpt.tiers import FarTier, TierConfig, TieredHistory, build_history, far_io
from cocoon_ckpt.tiers.far_io import private_file, stream_gemv, write_at
from state import Store
from state import version as state_version

U = 1 << 16  # one noise block: the smallest allocation unit


@settings(max_examples=25, deadline=None)
@given(
    slots=st.integers(0, 9),
    width=st.integers(1, 3000),
    chunk=st.integers(1, 5000),
    dtype=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_streamed_gemv_is_the_kernel_over_the_whole_shard(
    tmp_path_factory: pytest.TempPathFactory,
    slots: int,
    width: int,
    chunk: int,
    dtype: str,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    ring = rng.standard_normal((slots, width)).astype(dtype)
    mix = rng.standard_normal(slots)
    path = tmp_path_factory.mktemp("stream") / "shard"
    fd = private_file(str(path), ring.nbytes)
    try:
        write_at(fd, ring, 0)
        out = np.full(width, np.nan, dtype=dtype)
        stream_gemv(fd, mix, slots, width, out, chunk_bytes=chunk)
    finally:
        os.close(fd)
    assert np.array_equal(out, mix_history(mix, ring))


def _rss_kib(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def test_neither_process_holds_the_far_shard_in_its_resident_memory(tmp_path: Path) -> None:
    """16 slots of 4M coordinates (256 MiB) on disk: writing every slot, reading one back
    and two GEMVs leave both the trainer's and the far worker's resident memory within
    a quarter of the shard (a mapped shard grows both by all of it)."""
    slots, width = 16, 64 * U
    far = FarTier(1 << 30, folder=str(tmp_path))
    h = TieredHistory(slots, width, "float32", [far], {"far": 64}, U)
    try:
        shard = slots * width * 4
        mix = np.random.default_rng(0).standard_normal(slots)
        h.gemv(mix)  # the worker's buffers and compiled kernel, over a file of holes
        pid = far.worker_pid
        assert pid is not None
        own, worker = _rss_kib(), _rss_kib(pid)
        row = np.empty(width, dtype=np.float32)
        for s in range(slots):
            row[...] = s + 1
            h.write(s, row)
        assert np.array_equal(h.read(slots - 1), row)
        got = h.gemv(mix)
        got = h.gemv(mix)
        assert far.worker_pid == pid  # the same worker: its growth is measured
        assert got[0] == np.float32(mix_history(mix, np.arange(1, slots + 1.0)[:, None]))[0]
        grown_own = (_rss_kib() - own) * 1024
        grown_worker = (_rss_kib(pid) - worker) * 1024
        assert grown_own < shard / 4, (grown_own, shard)
        assert grown_worker < shard / 4, (grown_worker, shard)
        assert (tmp_path / os.listdir(tmp_path)[0] / "history").stat().st_size == shard
    finally:
        h.close()
    assert not os.listdir(tmp_path)


def test_host_budget_puts_the_rest_on_the_far_file_with_the_same_noise(tmp_path: Path) -> None:
    """A host budget of one unit: the planner places the other units in the far file
    on disk, and w_t is bit for bit the all-on-host ring's (whole keyed blocks per
    tier, I1; the fixed-order GEMV, I2)."""
    mech = BandMF.banded_sqrt(6, 40)
    dim, slots = 3 * U + 777, 5
    cfg = TierConfig(host_bytes=slots * U * 4, far_bytes=None, far_dir=str(tmp_path))
    history = build_history(slots, dim, "float32", cfg)
    key = bytes(range(32))
    ref = BandMFNoise(mech, dim, key, 1.3)
    tiered = BandMFNoise(mech, dim, key, 1.3, history=history)
    try:
        placed = {p["tier"]: (p["start"], p["stop"]) for p in history.placement()}
        assert set(placed) <= {"host", "far"} and "far" in placed
        assert placed.get("host", (0, 0))[1] - placed.get("host", (0, 0))[0] <= U
        assert [p.name for p in tmp_path.iterdir()][0].startswith("cocoon-far-")
        for _ in range(12):
            assert torch.equal(ref.step(), tiered.step())
        assert np.array_equal(history.gather(), ref.ring.numpy())
    finally:
        tiered.close()
    assert not list(tmp_path.iterdir())


def _commit_ring(url: Path, ring: HostRing, steps: list[int | None], step: int) -> list[Any]:
    """A version of step `step` at `url` holding `ring`'s slots as a job's noise record
    does (one shard over the whole width, each slot labelled with `steps`); its shards."""
    store = Store.open(str(url))
    store.acquire_lease()
    arrays: dict[str, np.ndarray] = {}
    entries = encode_slots(ring, steps, lambda a, b: ring_rows_name(0, a, b), None, {}, arrays, {})
    tx = store.begin(step)
    for name, values in arrays.items():
        tx.put_array(name, values)
    shards = [{"start": 0, "stop": ring.width, "slots": entries}]
    tx.put_record("noise", {"shards": shards})
    tx.commit()
    return shards


def test_a_stored_ring_is_restored_onto_the_far_file_row_by_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version whose ring is past what a version keeps in memory (here nothing is
    kept) verifies without holding its arrays, and restores into a history on the far file one row at a time: the allocations
    of the restore peak at a few rows (the row read, its decoding, the row written),
    not at the ring's twelve, and every slot is the stored one."""
    monkeypatch.setattr(state_version, "KEEP_BYTES", 0)
    slots, width = 12, 40 * U  # 10 MiB rows: one row per stored array
    ring = HostRing(slots, width, "float32")
    rng = np.random.default_rng(3)
    for s in range(slots):
        ring.write(s, rng.standard_normal(width, dtype=np.float32))
    steps: list[int | None] = [12, 13, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    shards = _commit_ring(tmp_path / "ring.zarr", ring, steps, 14)
    tracemalloc.start()
    try:  # every array verified, none kept
        version = Store.open(str(tmp_path / "ring.zarr"), create=False).latest()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert version is not None
    assert held < ring.nbytes / 4, (held, ring.nbytes)
    far_dir = tmp_path / "far"
    far_dir.mkdir()
    history = TieredHistory(
        slots, width, "float32", [FarTier(1 << 30, folder=str(far_dir))], {"far": 40}, U
    )
    try:
        tracemalloc.start()
        try:
            state = load_ring({"start": 0, "stop": width, "ring": history}, shards, version)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert state["ring"] is history and state["slot_steps"] == steps
        assert peak < 4 * width * 4 + (4 << 20), (peak, ring.nbytes)
        assert all(np.array_equal(history.read(s), ring.read(s)) for s in range(slots))
    finally:
        history.close()


# -- a job on the far file, SIGKILLed and resumed ----------------------------------------

HIDDEN = 8192  # mlp of 20 -> 8192 -> 4: 204,804 parameters, four noise blocks


def _train(store: Path, key: Path, tiers: dict[str, Any] | None) -> list[str]:
    extra = ["--tiers", json.dumps(tiers)] if tiers is not None else []
    return [
        *("train", "--example", "mlp", "--job-option", f"hidden={HIDDEN}"),
        *("--store", str(store), "--key-file", str(key), "--steps", "24"),
        *("--checkpoint-every", "4", "--bands", "8", "--batch-size", "16"),
        *("--dataset-size", "512", "--no-progress", *extra),
    ]


def _ring_rows(store: Path) -> dict[int, np.ndarray]:
    """The newest version's ring: each slot's stored row by the step it holds."""
    v = Store.open(str(store), create=False).latest()
    assert v is not None
    rows: dict[int, list[tuple[int, np.ndarray]]] = {}
    for shard in v.records["noise"]["shards"]:
        for _slot, step, array, row, _crc in shard["slots"]:
            rows.setdefault(step, []).append((shard["start"], v.array(array)[row]))
    return {step: np.concatenate([r for _, r in sorted(parts)]) for step, parts in rows.items()}


def _export(store: Path, key: Path, out: Path) -> dict[str, torch.Tensor]:
    assert main(["export", str(store), "--out", str(out), "--key-file", str(key)]) == 0
    return torch.load(out)  # type: ignore[no-any-return]


def _manifests(store: Path) -> set[str]:
    folder = store / "manifests"
    return {p.name for p in folder.glob("*.json")} if folder.exists() else set()


@pytest.mark.slow
def test_job_on_a_far_file_resumes_bit_exact_after_sigkill(tmp_path: Path) -> None:
    key = tmp_path / "noise.key"  # made by the first run, shared by every run
    gold = tmp_path / "gold.zarr"  # uninterrupted, the ring all on the host
    assert main(_train(gold, key, None)) == 0
    far_dir = tmp_path / "far"
    far_dir.mkdir()
    # a host budget of one unit of the 7-slot ring: the other three in the far file
    tiers = {"host_bytes": 7 * U * 4, "far_bytes": None, "far_dir": str(far_dir)}
    store = tmp_path / "run.zarr"
    cmd = [sys.executable, "-m", "cocoon_ckpt", *_train(store, key, tiers)]
    # 1. killed inside step 13, after the far worker's GEMV, before the ring is written
    env = {**os.environ, "COCOON_CRASH_AT": "noise.after_gemv:step=13"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr
    left = [p.name for p in far_dir.iterdir()]
    assert left and all(n.startswith("cocoon-far-") for n in left)  # what SIGKILL leaves
    # 2. resumed (the far file rebuilt from the store), killed by a real SIGKILL from
    # outside once it has committed a version of its own
    seen = _manifests(store)
    err = tmp_path / "second.err"
    with err.open("wb") as f:
        second = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
    while not _manifests(store) - seen and second.poll() is None:
        time.sleep(0.01)
    if second.poll() is None:
        second.send_signal(signal.SIGKILL)
    assert second.wait() in (-signal.SIGKILL, 0), err.read_text()
    # 3. to the end
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not list(far_dir.iterdir())  # dead owners' folders swept, its own removed
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 24
    assert "far" in {p["tier"] for p in latest.records["noise"]["placement"]}
    want, got = _ring_rows(gold), _ring_rows(store)
    assert sorted(want) == sorted(got)
    assert all(np.array_equal(want[s], got[s]) for s in want)  # the noise, bit for bit
    a, b = _export(gold, key, tmp_path / "a.pt"), _export(store, key, tmp_path / "b.pt")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _allocated(folder: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def test_a_restore_writes_no_zeros_onto_a_new_far_file_and_clears_a_used_one(
    tmp_path: Path,
) -> None:
    """A version early in a job stores few of the ring's slots. Restored onto a new far
    file, the others are left as the file's holes (zeros, never written: at 354M, b =
    16, writing them was 17.2 GB); restored onto a ring written before, they are
    zeroed."""
    slots, width = 8, 4 * U
    rng = np.random.default_rng(5)
    ring = HostRing(slots, width, "float32")
    for s in range(2):
        ring.write(s, rng.standard_normal(width, dtype=np.float32))
    steps: list[int | None] = [0, 1, None, None, None, None, None, None]
    shards = _commit_ring(tmp_path / "ring.zarr", ring, steps, 2)
    version = Store.open(str(tmp_path / "ring.zarr"), create=False).latest()
    assert version is not None
    for used in (False, True):
        far_dir = tmp_path / f"far-{used}"
        far_dir.mkdir()
        history = TieredHistory(
            slots, width, "float32", [FarTier(1 << 30, folder=str(far_dir))], {"far": 4}, U
        )
        try:
            if used:  # a live ring restored again: every slot written before
                for s in range(slots):
                    history.write(s, np.full(width, 7.0, dtype=np.float32))
            load_ring({"start": 0, "stop": width, "ring": history}, shards, version)
            for s in range(slots):
                want = ring.read(s) if s < 2 else np.zeros(width, dtype=np.float32)
                assert np.array_equal(history.read(s), want), (used, s)
            if not used:
                # the two stored rows' bytes and a page or two: the six others are holes
                assert _allocated(far_dir) <= 2 * width * 4 + (1 << 20), _allocated(far_dir)
        finally:
            history.close()


@settings(max_examples=20, deadline=None)
@given(
    slots=st.integers(1, 6),
    width=st.integers(1, 5000),
    written=st.sets(st.integers(0, 5)),
    chunk=st.integers(64, 1 << 16),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_sparse_shards_holes_read_as_the_zeros_a_read_gives(
    tmp_path_factory: pytest.TempPathFactory,
    slots: int,
    width: int,
    written: set[int],
    chunk: int,
    seed: int,
) -> None:
    """Slots never written are holes of the far file; `read_at` fills a range that is all
    hole with zeros instead of reading it (no page-cache page faulted in), and the GEMV
    over the file is the kernel over the same ring with those rows zero, bit for bit."""
    rng = np.random.default_rng(seed)
    ring = np.zeros((slots, width), dtype=np.float32)
    path = tmp_path_factory.mktemp("sparse") / "shard"
    fd = private_file(str(path), ring.nbytes)
    try:
        for s in sorted(w for w in written if w < slots):
            ring[s] = rng.standard_normal(width).astype(np.float32)
            write_at(fd, ring[s], s * width * 4)
        mix = rng.standard_normal(slots)
        out = np.full(width, np.nan, dtype=np.float32)
        stream_gemv(fd, mix, slots, width, out, chunk_bytes=chunk)
        assert np.array_equal(out.view(np.int32), mix_history(mix, ring).view(np.int32))
        for s in range(slots):
            row = np.full(width, np.nan, dtype=np.float32)
            far_io.read_at(fd, row, s * width * 4)
            assert np.array_equal(row.view(np.int32), ring[s].view(np.int32))
    finally:
        os.close(fd)


def test_a_hole_is_not_read_and_a_truncated_file_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nbytes = 64 << 20  # 16 MiB of data in the middle of 64 MiB of file
    fd = private_file(str(tmp_path / "shard"), nbytes)
    try:
        write_at(fd, np.ones(4 << 20, dtype=np.float32), 24 << 20)
        reads: list[int] = []
        real = os.preadv
        monkeypatch.setattr(
            far_io.os, "preadv", lambda f, bufs, off: reads.append(off) or real(f, bufs, off)
        )
        hole = np.full(1 << 20, np.nan, dtype=np.float32)
        far_io.read_at(fd, hole, 0)  # the first 4 MiB: a hole
        far_io.read_at(fd, hole, 60 << 20)  # the last 4 MiB: a hole up to the end
        assert reads == [] and not hole.any()
        data = np.zeros(1 << 20, dtype=np.float32)
        far_io.read_at(fd, data, 24 << 20)
        assert reads and (data == 1).all()
        past = np.empty(1 << 20, dtype=np.float32)
        with pytest.raises(OSError, match="ended"):
            far_io.read_at(fd, past, nbytes - 1024)  # runs past the end: refused
    finally:
        os.close(fd)
