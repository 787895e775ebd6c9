"""`Checkpointer(lent_rows="wait")` (`format.snapshot.SharedRows(on_overwrite="wait")`,
#31 item 2): a step that must overwrite a ring row lent to the version in flight, which
the writer has not begun, has the writer write that row next and waits for it instead
of copying it. No row is ever copied (the pool's counter and tracemalloc agree), the
stored bytes are those of the copying default and of a synchronous write, a failed
writer lets the step go on, and a lent row is reached before the next checkpoint
exactly when 2k >= b (k steps between checkpoints, b bands).

The writer is made slow deterministically: it is held on an event until the test has
seen the step wait (the pool's condition, no sleeps)."""

from __future__ import annotations

import dataclasses
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt.format import ring_rows, snapshot
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
    # only rows alone in their array are lent; a small model's rows are made so here
    monkeypatch.setattr(ring_rows, "CHUNK_BYTES", 1)


def _job(
    tmp_path: Path,
    name: str,
    *,
    async_write: bool,
    lent_rows: Any = "copy",
    wait_s: float | None = None,
) -> Any:
    # mlp 20 -> 8192 -> 4: 204,804 parameters, a 0.8 MB ring row
    cfg = dataclasses.replace(
        job_config("mlp", bands=BANDS, steps=60), options={"hidden": 8192}, checkpoint_every=7
    )
    trainer = build_trainer(cfg, KEY)
    records: dict[str, Any] = dict(job_records(cfg, trainer, KEY, None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    store = Store.open(str(tmp_path / f"{name}.zarr"))
    store.acquire_lease()
    # the writer is held on events here: a step waits as long as it takes (no copy
    # after LENT_ROW_WAIT_S) unless a test bounds it
    ck = Checkpointer(
        store, async_write=async_write, keep_last=3, lent_rows=lent_rows, lent_row_wait_s=wait_s
    )
    return trainer, ck, records


def _arrays(ck: Checkpointer) -> dict[str, tuple[str, tuple[int, ...]]]:
    version = ck.store.read(ck.store.versions()[-1], verify=True)
    return {n: (m.checksum, m.shape) for n, m in version.manifest.arrays.items()}


def _assert_rows_as_seen(ck: Checkpointer, before: np.ndarray) -> None:
    """The newest version's ring rows are, bit for bit, those the snapshot saw."""
    version = ck.store.read(ck.store.versions()[-1], verify=True)
    (shard,) = records_of(version.manifest)["noise"]["shards"]
    for ref in ring_rows.slot_refs(shard["slots"]):
        assert np.array_equal(ring_rows.slot_values(version, ref), before[ref.slot])


def _written_synchronously(
    tmp_path: Path, name: str, records: dict[str, Any]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The arrays of the same version (2 * BANDS steps in) written synchronously by a
    twin job."""
    twin, sync, _ = _job(tmp_path, name, async_write=False)
    try:
        for _ in range(2 * BANDS):
            twin.train_step()
        sync.save(twin, dict(records))
        return _arrays(sync)
    finally:
        sync.close()
        twin.close()


def _hold_writer(ck: Checkpointer, gate: threading.Event) -> None:
    """The writer waits for `gate` before it begins a version."""
    write = ck._write

    def held(snap: Any) -> Any:
        gate.wait()
        return write(snap)

    ck._write = held  # type: ignore[method-assign]


def _wait_until(rows: SharedRows, ready: Callable[[], bool]) -> None:
    with rows._cond:
        rows._cond.wait_for(ready)


def _pool_bytes(snap: tracemalloc.Snapshot) -> int:
    """Bytes allocated by `format/snapshot.py` (the pool's copies) still held."""
    only = tracemalloc.Filter(True, snapshot.__file__)
    return sum(s.size for s in snap.filter_traces([only]).statistics("filename"))


def test_the_writer_takes_the_row_the_ring_waits_on_next_and_nothing_is_copied() -> None:
    rows = SharedRows(on_overwrite="wait")
    ring = TieredHistory.single_host(3, 5, np.float32)
    for s in range(3):
        ring.write(s, np.full(5, s, dtype=np.float32))
    with rows.lending():
        views = [lend_row(ring, s) for s in range(3)]
    model = np.arange(4, dtype=np.float32)
    arrays: dict[str, np.ndarray] = {"model": model}
    for s, v in enumerate(views):
        assert v is not None
        arrays[f"r{s}"] = v
    assert rows.adopt(arrays)
    written: list[tuple[str, np.ndarray]] = []
    in_model, go = threading.Event(), threading.Event()

    def writer() -> None:
        try:
            order = ["model", "r2", "r1", "r0"]
            while order:
                name = rows.next_array(order)
                order.remove(name)
                lent = rows.claim(name)
                arr = arrays[name] if lent is None else lent
                if name == "model":  # slow: held until the ring waits on r1
                    in_model.set()
                    go.wait()
                written.append((name, arr.copy()))
                rows.written(name)
        finally:
            rows.writer_done()

    stepped = threading.Event()

    def step() -> None:
        ring.write(1, np.full(5, -1, dtype=np.float32))  # lent row r1, not begun
        stepped.set()

    w = threading.Thread(target=writer)
    w.start()
    in_model.wait()
    t = threading.Thread(target=step)
    t.start()
    _wait_until(rows, lambda: "r1" in rows._wanted)
    # r1 becomes written only after `go`: the step is still waiting, and nothing copied
    assert not stepped.is_set()
    assert rows.copied == 0
    go.set()
    t.join()
    w.join()
    assert [n for n, _ in written] == ["model", "r1", "r2", "r0"]  # r1 out of its turn
    for name, arr in written[1:]:
        assert np.array_equal(arr, np.full((1, 5), int(name[1]), dtype=np.float32))
    assert rows.copied == 0
    assert ring.read(1)[0] == -1
    rows.release()
    ring.close()


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="on_overwrite='never': must be one of 'copy', 'wait'"):
        SharedRows(on_overwrite="never")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["copy", "wait"])
def test_a_step_over_a_lent_row_copies_or_waits_and_the_stored_bytes_are_the_same(
    tmp_path: Path, policy: str
) -> None:
    trainer, ck, records = _job(tmp_path, policy, async_write=True, lent_rows=policy)
    gate = threading.Event()
    _hold_writer(ck, gate)
    rows = ck._lent
    try:
        for _ in range(2 * BANDS):  # every slot written since the start
            trainer.train_step()
        history = trainer.noise.history
        row = history.width * history.dtype.itemsize
        before = history.gather()
        ck.save(trainer, dict(records))  # no parent: all 7 rows lent
        tracemalloc.start()
        try:
            stepped = threading.Event()

            def steps() -> None:
                for _ in range(BANDS):  # every lent row overwritten
                    trainer.train_step()
                stepped.set()

            t = threading.Thread(target=steps)
            t.start()
            if policy == "wait":
                # the first step waits on the oldest row, which the held writer has
                # not begun: it cannot go on until the writer is let go
                _wait_until(rows, lambda: bool(rows._wanted))
                assert not stepped.is_set()
                gate.set()
            t.join()
            held = _pool_bytes(tracemalloc.take_snapshot())  # copies live until recycled
        finally:
            tracemalloc.stop()
            gate.set()
        if policy == "wait":
            assert rows.copied == 0
            assert held < row, (held, row)
        else:
            assert rows.copied == BANDS - 1  # the writer never ran: every row copied
            assert held >= (BANDS - 1) * row, (held, row)
        ck.wait()
        _assert_rows_as_seen(ck, before)
        stored = _arrays(ck)
    finally:
        gate.set()
        ck.close()
        trainer.close()

    # the same version written synchronously by the same job: the same bytes
    assert _written_synchronously(tmp_path, f"twin-{policy}", records) == stored


def test_a_failed_writer_lets_a_waiting_step_go_on(tmp_path: Path) -> None:
    trainer, ck, records = _job(tmp_path, "failed", async_write=True, lent_rows="wait")
    gate = threading.Event()
    _hold_writer(ck, gate)

    def refuse(snap: Any) -> Any:
        raise OSError("the disk is gone")

    ck._begin = refuse  # type: ignore[method-assign]
    try:
        for _ in range(BANDS):
            trainer.train_step()
        ck.save(trainer, dict(records))
        stepped = threading.Event()

        def step() -> None:
            trainer.train_step()  # overwrites the oldest lent row
            stepped.set()

        t = threading.Thread(target=step)
        t.start()
        _wait_until(ck._lent, lambda: bool(ck._lent._wanted))
        assert not stepped.is_set()
        gate.set()  # the writer fails before any row: the step goes on
        t.join()
        assert ck._lent.copied == 0
        with pytest.raises(OSError, match="the disk is gone"):
            ck.wait()
    finally:
        gate.set()
        ck.close()
        trainer.close()


@pytest.mark.parametrize(("every", "reached"), [(3, False), (4, True)])
def test_a_lent_row_is_reached_before_the_next_checkpoint_when_2k_is_at_least_b(
    tmp_path: Path, every: int, reached: bool
) -> None:
    # b = 8: the rows of steps t-k+1..t; the oldest is overwritten at step t+8-k, which
    # comes before the next checkpoint (after step t+k) when 2k >= 8
    trainer, ck, records = _job(tmp_path, f"k{every}", async_write=True)
    gate = threading.Event()
    try:
        for _ in range(2 * BANDS):
            trainer.train_step()
        ck.save(trainer, dict(records))
        ck.wait()  # the parent: the next version's new rows are the k steps' own
        _hold_writer(ck, gate)
        for _ in range(every):
            trainer.train_step()
        ck.save(trainer, dict(records))
        for _ in range(every):  # up to the next checkpoint, the writer held
            trainer.train_step()
        assert (ck._lent.copied > 0) is reached
        gate.set()
        ck.wait()
    finally:
        gate.set()
        ck.close()
        trainer.close()
