"""A large version's writer thread runs at nice 10 (the default), or at SCHED_IDLE (and
nice 10) with `checkpoint.BULK_IDLE`; the epsilon's at nice 10 only; the priority changes
no stored bit."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.train import checkpoint
from cocoon_ckpt.train.checkpoint import ASYNC_FLUSH, Checkpointer
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store, hooks

from .conftest import job_config


def _write_two(url: str, seen: list[tuple[str, int, int]]) -> Store:
    """Two versions of one job written in the background; `seen` gets each writer's
    thread name, scheduling policy and nice."""
    cfg = job_config(bands=4, steps=12)
    trainer = build_trainer(cfg, bytes(32))
    records: dict[str, Any] = dict(job_records(cfg, trainer, bytes(32), None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))

    def note(name: str, ctx: Mapping[str, Any]) -> None:
        me = threading.get_native_id()
        seen.append(
            (threading.current_thread().name, os.sched_getscheduler(0), os.getpriority(0, me))
        )

    store = Store.open(url)
    store.acquire_lease()
    ck = Checkpointer(store, async_write=True, keep_last=3)
    hooks.arm(ASYNC_FLUSH, note)
    try:
        for _ in range(2):
            for _ in range(3):
                trainer.train_step()
            ck.save(trainer, dict(records))
        epsilon = ck._accounting.submit(os.sched_getscheduler, 0).result()
        ck.close()
    finally:
        hooks.disarm_all()
    assert epsilon == os.SCHED_OTHER  # CPU work that must finish: nice 10 only
    return store


def _bits(store: Store) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    return [
        {n: (m.checksum, tuple(m.shape)) for n, m in store.manifest(v).arrays.items()}
        for v in store.versions()
    ]


def test_the_large_version_writer_at_sched_idle_or_nice_10_stores_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checkpoint, "BULK_BYTES", 1)  # every version counts as large
    nice: list[tuple[str, int, int]] = []  # the default
    b = _write_two(str(tmp_path / "nice.zarr"), nice)
    assert [n.split("_")[0] for n, _, _ in nice] == ["ckpt-bulk", "ckpt-bulk"]
    assert all(policy == os.SCHED_OTHER and n >= 10 for _, policy, n in nice)

    monkeypatch.setattr(checkpoint, "BULK_IDLE", True)
    idle: list[tuple[str, int, int]] = []
    a = _write_two(str(tmp_path / "idle.zarr"), idle)
    assert [n.split("_")[0] for n, _, _ in idle] == ["ckpt-bulk", "ckpt-bulk"]
    assert all(policy == os.SCHED_IDLE and nice >= 10 for _, policy, nice in idle)

    assert len(_bits(a)) == 2 and _bits(a) == _bits(b)
    latest = a.latest()  # reads back, every chunk and checksum verified
    assert latest is not None and latest.manifest.step == 6
