"""A checkpoint writes its new ring rows from the live ring (`format.snapshot.SharedRows`,
#31 item 2): neither a checkpoint nor an asynchronous one in flight allocates the ring
again (tracemalloc sees every numpy buffer), a row the ring overwrites before the writer
reaches it is copied out first (one row), one the writer is in is waited for, and the
stored bits are those of a version whose rows were copied."""

from __future__ import annotations

import dataclasses
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt.format import ring_rows
from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.format.snapshot import SharedRows, lend_row
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.tiers.history import TieredHistory
from cocoon_ckpt.train.checkpoint import Checkpointer
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store

from .conftest import job_config

KEY = bytes(range(32))
BANDS = 8  # 7 ring slots


@pytest.fixture(autouse=True)
def _one_row_per_array(monkeypatch: pytest.MonkeyPatch) -> None:
    # rows of 16 MiB or more are one array each, and only those are lent; a small model's
    # rows are made so here (the stored layout of these tests' versions only)
    monkeypatch.setattr(ring_rows, "CHUNK_BYTES", 1)


def _job(
    tmp_path: Path, name: str, *, async_write: bool
) -> tuple[Any, Checkpointer, dict[str, Any]]:
    # mlp 20 -> 8192 -> 4: 204,804 parameters, a 0.8 MB ring row
    cfg = dataclasses.replace(
        job_config("mlp", bands=BANDS, steps=60), options={"hidden": 8192}, checkpoint_every=7
    )
    trainer = build_trainer(cfg, KEY)
    records: dict[str, Any] = dict(job_records(cfg, trainer, KEY, None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    store = Store.open(str(tmp_path / f"{name}.zarr"))
    store.acquire_lease()
    ck = Checkpointer(store, async_write=async_write, keep_last=3, lent_rows="copy")
    return trainer, ck, records


def _arrays(ck: Checkpointer) -> dict[str, tuple[str, tuple[int, ...]]]:
    version = ck.store.read(ck.store.versions()[-1], verify=True)
    return {n: (m.checksum, m.shape) for n, m in version.manifest.arrays.items()}


def test_a_checkpoint_of_every_slot_allocates_no_ring(tmp_path: Path) -> None:
    trainer, ck, records = _job(tmp_path, "sync", async_write=False)
    try:
        for _ in range(2 * BANDS):  # every slot written since the first version
            trainer.train_step()
        history = trainer.noise.history
        assert isinstance(history, TieredHistory)
        row = history.width * history.dtype.itemsize
        tracemalloc.start()
        try:
            ck.save(trainer, dict(records))  # no parent: all 7 slots are new
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len([a for a in _arrays(ck) if a.startswith("ring/")]) == BANDS - 1
        # the model's copy is about one row; the ring (7 rows) is never copied
        assert peak < 3 * row, (peak, row)
    finally:
        ck.close()
        trainer.close()


def test_an_async_checkpoint_in_flight_adds_no_ring_and_stores_the_copied_bits(
    tmp_path: Path,
) -> None:
    trainer, ck, records = _job(tmp_path, "async", async_write=True)
    gate = threading.Event()
    write = ck._write

    def held(snap: Any) -> Any:  # the writer waits until the steps below are taken
        gate.wait()
        return write(snap)

    ck._write = held  # type: ignore[method-assign]
    try:
        for _ in range(2 * BANDS):
            trainer.train_step()
        history = trainer.noise.history
        row = history.width * history.dtype.itemsize
        before = history.gather()
        tracemalloc.start()
        try:
            ck.save(trainer, dict(records))
            saved = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            trainer.train_step()  # overwrites a lent row the writer has not begun
            stepped = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert saved < 3 * row, (saved, row)  # the model's copy, no ring row
        # the step's own GEMV output and the one row copied out: not a ring (7 rows)
        assert stepped < 3 * row, (stepped, row)
        for _ in range(BANDS):  # every lent row overwritten while the write waits
            trainer.train_step()
        gate.set()
        ck.wait()
        version = ck.store.read(ck.store.versions()[-1], verify=True)
        (shard,) = records_of(version.manifest)["noise"]["shards"]
        refs = ring_rows.slot_refs(shard["slots"])
        assert sorted(r.slot for r in refs) == list(range(history.slots))
        for ref in refs:  # what the snapshot saw, bit for bit
            assert np.array_equal(ring_rows.slot_values(version, ref), before[ref.slot])
    finally:
        gate.set()
        ck.close()
        trainer.close()

    # the same version written synchronously by the same job: the same bits everywhere
    twin, sync, _ = _job(tmp_path, "twin", async_write=False)
    try:
        for _ in range(2 * BANDS):
            twin.train_step()
        sync.save(twin, dict(records))
        assert _arrays(sync) == _arrays(ck)
    finally:
        sync.close()
        twin.close()


def test_the_ring_waits_for_a_row_the_writer_is_in_and_copies_one_it_has_not_begun() -> None:
    rows = SharedRows()
    ring = TieredHistory.single_host(2, 5, np.float32)
    ring.write(0, np.arange(5, dtype=np.float32))
    ring.write(1, np.arange(5, 10, dtype=np.float32))
    with rows.lending():
        a, b = lend_row(ring, 0), lend_row(ring, 1)
    assert a is not None and b is not None and not a.flags.writeable
    arrays = {"a": a, "b": b}
    assert rows.adopt(arrays)
    assert rows.claim("a") is a  # the writer is in row a
    done = threading.Event()

    def overwrite() -> None:
        ring.write(0, np.full(5, -1, dtype=np.float32))
        done.set()

    t = threading.Thread(target=overwrite)
    t.start()
    assert not done.wait(0.2)  # blocked until the writer is out of row a
    assert np.array_equal(a, np.arange(5, dtype=np.float32)[None])
    rows.written("a")
    t.join()
    assert ring.read(0)[0] == -1
    ring.write(1, np.full(5, -2, dtype=np.float32))  # row b not begun: copied out first
    copied = rows.claim("b")
    assert copied is not None and copied is not b
    assert np.array_equal(copied, np.arange(5, 10, dtype=np.float32)[None])
    rows.written("b")
    rows.release()
    ring.write(1, np.zeros(5, dtype=np.float32))  # released: no guard left
    ring.close()
