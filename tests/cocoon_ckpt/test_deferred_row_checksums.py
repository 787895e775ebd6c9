"""A lent ring row's checksum is its writer's (`SharedRows.defer_checksum`): the training
thread reads no lent row at a checkpoint, and the record the version stores is the one
a snapshot that copied its rows stores, bit for bit; a record whose row was never
written is refused before it is written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt.format import ring_rows
from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.format.snapshot import SharedRows, lend_row
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.tiers.history import TieredHistory
from cocoon_ckpt.train.checkpoint import Checkpointer, take_snapshot
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store

from .conftest import job_config

KEY = bytes(range(32))
BANDS = 5  # 4 ring slots


@pytest.fixture(autouse=True)
def _one_row_per_array(monkeypatch: pytest.MonkeyPatch) -> None:
    # only rows alone in their array are lent: a small model's rows are made so here
    monkeypatch.setattr(ring_rows, "CHUNK_BYTES", 1)


def _trainer() -> Any:
    cfg = dataclasses.replace(
        job_config("mlp", bands=BANDS, steps=30), options={"hidden": 1024}, checkpoint_every=4
    )
    trainer = build_trainer(cfg, KEY)
    records: dict[str, Any] = dict(job_records(cfg, trainer, KEY, None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    return trainer, records


@pytest.mark.parametrize("async_write", [True, False])
def test_the_stored_record_is_the_copied_snapshots_and_no_lent_row_is_read_at_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_write: bool
) -> None:
    trainer, records = _trainer()
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    ck = Checkpointer(store, async_write=async_write, keep_last=3)
    try:
        for _ in range(2 * BANDS):  # every slot written
            trainer.train_step()
        assert isinstance(trainer.noise.history, TieredHistory)
        # the record of the same state with every row copied (no lender: no deferral)
        copied = take_snapshot(trainer, None, dict(records)).records["noise"]
        before = trainer.noise.history.gather()
        calls: list[int] = []
        real = ring_rows.row_checksum
        monkeypatch.setattr(ring_rows, "row_checksum", lambda row: calls.append(1) or real(row))
        ck.save(trainer, dict(records))  # no parent: every slot new, every row lent
        assert calls == []  # the training thread read no lent row
        ck.wait()
        version = store.read(store.versions()[-1], verify=True)
        stored = records_of(version.manifest)["noise"]
        assert stored["shards"][0]["slots"] == copied["shards"][0]["slots"]
        for ref in ring_rows.slot_refs(stored["shards"][0]["slots"]):
            values = ring_rows.slot_values(version, ref)
            assert np.array_equal(values, before[ref.slot])
            assert ref.checksum == real(values)
    finally:
        ck.close()
        trainer.close()


def test_a_record_whose_lent_row_was_never_written_is_refused() -> None:
    trainer, _ = _trainer()
    try:
        for _ in range(BANDS):
            trainer.train_step()
        lender = SharedRows()
        history = trainer.noise.history
        with lender.lending():
            view = lend_row(history, 0)
        assert view is not None
        entry: list[Any] = [0, 0, "ring/x", 0, None]
        assert lender.defer_checksum(view, entry)
        assert entry[4] == SharedRows.PENDING_CHECKSUM
        with pytest.raises(ValueError, match="malformed"):  # no reader takes it either
            ring_rows.slot_refs([entry])
        with pytest.raises(RuntimeError, match="was not written"):
            lender.check_checksums()
        lender.release()
        lender.check_checksums()  # nothing deferred once released
        # no lender: a row that is no lent view is computed by the caller
        assert not lender.defer_checksum(view, [0, 0, "ring/x", 0, None])
    finally:
        trainer.close()
