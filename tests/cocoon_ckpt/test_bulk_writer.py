"""A large version is written by the checkpointer's lowered writer thread (nice 10), a
small one by the regular writer; which thread writes changes no stored bit."""

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


def _write_two(url: str, seen: list[tuple[str, int]]) -> Store:
    """Versions at steps 3 and 6 of one job (the second one incremental), written in
    the background; `seen` gets each writer's thread name and nice."""
    cfg = job_config(bands=4, steps=12)
    trainer = build_trainer(cfg, bytes(32))
    records: dict[str, Any] = dict(job_records(cfg, trainer, bytes(32), None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))

    def note(name: str, ctx: Mapping[str, Any]) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen.append((threading.current_thread().name, nice))

    store = Store.open(url)
    store.acquire_lease()
    ck = Checkpointer(store, async_write=True, keep_last=3)
    hooks.arm(ASYNC_FLUSH, note)
    try:
        for _ in range(2):
            for _ in range(3):
                trainer.train_step()
            ck.save(trainer, dict(records))
        ck.close()
    finally:
        hooks.disarm_all()
    return store


def _arrays(store: Store) -> list[dict[str, tuple[str, tuple[int, ...]]]]:
    """Per version, each array's checksum and shape (paths differ between stores)."""
    out = []
    for v in store.versions():
        arrays = store.manifest(v).arrays
        out.append({n: (m.checksum, tuple(m.shape)) for n, m in arrays.items()})
    return out


def test_large_versions_go_to_the_lowered_writer_and_store_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    small: list[tuple[str, int]] = []
    regular = _write_two(str(tmp_path / "small.zarr"), small)
    assert [n.split("_")[0] for n, _ in small] == ["ckpt", "ckpt"]
    assert all(nice == own for _, nice in small)

    monkeypatch.setattr(checkpoint, "BULK_BYTES", 1)  # every version counts as large
    large: list[tuple[str, int]] = []
    bulk = _write_two(str(tmp_path / "large.zarr"), large)
    assert [n.split("_")[0] for n, _ in large] == ["ckpt-bulk", "ckpt-bulk"]
    assert all(nice >= max(own, 10) for _, nice in large)

    assert len(_arrays(bulk)) == 2
    assert _arrays(bulk) == _arrays(regular)
    latest = bulk.latest()  # reads back, every chunk and checksum verified
    assert latest is not None and latest.manifest.step == 6
