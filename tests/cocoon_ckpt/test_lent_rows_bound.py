"""`lent_rows="wait"` is the default, with a bound (#31 item 2): a step that must
overwrite a lent ring row waits for the writer to begin that row at most
`max_wait_s` (`LENT_ROW_WAIT_S` for a `Checkpointer`), then copies it out as "copy"
does; a row the writer is in is waited for to its end whatever the bound, as "copy"
also waits. The stored bytes are a synchronous write's either way.

The writer is held on events (never on the clock): a bound of 0 s makes the copy happen
at once, so no test waits for a deadline."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt.format import ring_rows
from cocoon_ckpt.format.snapshot import LENT_ROW_WAIT_S, SharedRows, lend_row
from cocoon_ckpt.tiers.history import TieredHistory
from cocoon_ckpt.train.checkpoint import Checkpointer
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .test_lent_rows_wait import (
    BANDS,
    _arrays,
    _assert_rows_as_seen,
    _hold_writer,
    _job,
    _written_synchronously,
)


@pytest.fixture(autouse=True)
def _one_row_per_array(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_rows, "CHUNK_BYTES", 1)


def _lent_ring(rows: SharedRows) -> tuple[TieredHistory, dict[str, np.ndarray]]:
    ring = TieredHistory.single_host(3, 5, np.float32)
    for s in range(3):
        ring.write(s, np.full(5, s, dtype=np.float32))
    with rows.lending():
        views = [lend_row(ring, s) for s in range(3)]
    arrays: dict[str, np.ndarray] = {}
    for s, v in enumerate(views):
        assert v is not None
        arrays[f"r{s}"] = v
    assert rows.adopt(arrays)
    return ring, arrays


def test_waiting_is_the_default_and_bounded(tmp_path: Path) -> None:
    assert JobOptions().lent_rows == "wait"
    store = Store.open(str(tmp_path / "s.zarr"))
    ck = Checkpointer(store)
    try:
        assert ck._lent.on_overwrite == "wait"
        assert ck._lent.max_wait_s == LENT_ROW_WAIT_S > 0
    finally:
        ck.close()
    with pytest.raises(ValueError, match=r"max_wait_s=-1\.0: must be >= 0 seconds, or None"):
        SharedRows(on_overwrite="wait", max_wait_s=-1.0)


def test_a_row_the_writer_has_not_begun_is_copied_once_the_bound_is_past() -> None:
    rows = SharedRows(on_overwrite="wait", max_wait_s=0.0)
    ring, arrays = _lent_ring(rows)
    view = arrays["r1"]
    ring.write(1, np.full(5, -1, dtype=np.float32))  # no writer at all: copied, not stuck
    assert rows.copied == 1
    assert rows._wanted == []  # the writer is not sent to it any more
    copy = rows.claim("r1")
    assert copy is not None and copy is not view and copy is arrays["r1"]
    assert np.array_equal(copy, np.full((1, 5), 1, dtype=np.float32))  # what was lent
    assert ring.read(1)[0] == -1
    rows.written("r1")
    rows.release()
    ring.close()


def test_a_row_the_writer_is_in_is_waited_for_past_the_bound() -> None:
    rows = SharedRows(on_overwrite="wait", max_wait_s=0.0)
    ring, arrays = _lent_ring(rows)
    assert rows.claim("r1") is arrays["r1"]  # the writer is in row r1
    done = threading.Event()

    def step() -> None:
        ring.write(1, np.full(5, -1, dtype=np.float32))
        done.set()

    t = threading.Thread(target=step)
    t.start()
    assert not done.wait(0.2)  # held until the writer is out of r1, bound or not
    assert np.array_equal(arrays["r1"], np.full((1, 5), 1, dtype=np.float32))
    rows.written("r1")
    t.join()
    assert rows.copied == 0 and ring.read(1)[0] == -1
    rows.release()
    ring.close()


def test_a_held_writer_costs_each_step_the_bound_and_the_bytes_stay(tmp_path: Path) -> None:
    trainer, ck, records = _job(tmp_path, "bound", async_write=True, lent_rows="wait", wait_s=0.0)
    gate = threading.Event()
    _hold_writer(ck, gate)
    try:
        for _ in range(2 * BANDS):  # every slot written since the start
            trainer.train_step()
        before = trainer.noise.history.gather()
        ck.save(trainer, dict(records))  # no parent: all 7 rows lent
        for _ in range(BANDS):  # every lent row overwritten, the writer never begun
            trainer.train_step()
        assert ck._lent.copied == BANDS - 1
        gate.set()
        ck.wait()
        _assert_rows_as_seen(ck, before)
        stored = _arrays(ck)
    finally:
        gate.set()
        ck.close()
        trainer.close()
    assert _written_synchronously(tmp_path, "twin", records) == stored
