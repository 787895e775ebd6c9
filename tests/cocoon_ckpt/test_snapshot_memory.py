"""A snapshot copies only the ring slots new since its parent, never the ring (#31 item 2):
measured by tracemalloc, which sees every numpy buffer the snapshot allocates."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
from pathlib import Path

import numpy as np

from cocoon_ckpt import Checkpointer
from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.checkpoint import take_snapshot
from cocoon_ckpt.train.job_records import job_records
from state import Store

from .conftest import job_config

KEY = bytes(range(32))


def test_a_snapshot_allocates_the_new_slots_not_the_ring(tmp_path: Path) -> None:
    # mlp 20 -> 8192 -> 4: 204,804 parameters; b = 32 keeps 31 slots (25 MB of ring)
    cfg = dataclasses.replace(
        job_config("mlp", bands=32, steps=40), options={"hidden": 8192}, checkpoint_every=4
    )
    trainer = build_trainer(cfg, KEY)
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    ckpt = Checkpointer(store, async_write=False)
    try:
        records = job_records(cfg, trainer, KEY, None)
        for _ in range(31):  # every slot written
            trainer.train_step()
        ckpt.save(trainer, records)  # the parent holds all 31 slots
        for _ in range(4):
            trainer.train_step()
        history = trainer.noise.history
        row = history.width * history.dtype.itemsize
        ring = history.slots * row
        tracemalloc.start()
        try:
            snap = take_snapshot(trainer, ckpt.last, records)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        new_rows = sum(
            a.nbytes for a in snap.arrays.values() if a.ndim == 2 and a.shape[1] == history.width
        )
        assert new_rows == 4 * row  # the four slots of steps 31..34, copied once
        assert peak < 4 * row + ring / 4, (peak, ring)
        assert all(np.isfinite(a).all() for a in snap.arrays.values() if a.dtype.kind == "f")
    finally:
        ckpt.close()
        trainer.close()
        store.release_lease()


def test_a_snapshot_dropped_unwritten_frees_its_buffers() -> None:
    # a snapshot taken outside a checkpointer (a benchmark's, a tool's) is never handed
    # back to BUFFERS: its buffers must go with it, not stay resident to the end
    cfg = dataclasses.replace(job_config("mlp", bands=8, steps=20), options={"hidden": 8192})
    trainer = build_trainer(cfg, KEY)
    try:
        for _ in range(8):
            trainer.train_step()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            snap = take_snapshot(trainer, None, {})
            held = tracemalloc.get_traced_memory()[0] - before
            assert held >= snap.nbytes > 0
            del snap
            gc.collect()
            left = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert left < held / 10, (left, held)
    finally:
        trainer.close()
