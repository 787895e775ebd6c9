"""A checkpointer's snapshots copy into the buffers of the last written one
(`SnapshotBuffers`): reused only after that version is written, never a buffer the
pool did not hand out, and no stored bit changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt.format import snapshot
from cocoon_ckpt.format.metrics import TrainingMetrics
from cocoon_ckpt.format.snapshot import SnapshotBuffers
from cocoon_ckpt.train.checkpoint import Checkpointer
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.runner import build_trainer
from state import Store

from .conftest import job_config


def test_buffers_come_back_only_from_the_pool_and_only_the_last_snapshot_is_kept() -> None:
    pool = SnapshotBuffers()
    a = pool.take((3, 5), np.dtype(np.float32))
    b = pool.take((3, 5), np.dtype(np.float32))
    assert a is not b
    foreign = np.empty((3, 5), dtype=np.float32)
    pool.recycle([a, foreign])
    assert pool.take((3, 5), np.dtype(np.float32)) is a
    assert pool.take((3, 5), np.dtype(np.float32)) is not foreign  # never handed out
    assert pool.take((3, 5), np.dtype(np.float64)).dtype == np.float64  # by dtype too
    pool.recycle([b])
    pool.recycle([])  # a later snapshot's recycle drops what was kept before
    assert pool.take((3, 5), np.dtype(np.float32)) is not b
    c = pool.take((2,), np.dtype(np.float32))
    pool.recycle([c])
    pool.trim()  # what a snapshot did not take is not held while it is written
    assert pool.take((2,), np.dtype(np.float32)) is not c


def _versions(url: str, checkpoints: int, taken: list[int]) -> list[dict[str, Any]]:
    """`checkpoints` async versions, 3 steps apart, of one job; per version each
    array's checksum and shape. `taken` gets the id of every buffer handed out."""
    cfg = job_config(bands=4, steps=3 * checkpoints)
    trainer = build_trainer(cfg, bytes(32))
    records: dict[str, Any] = dict(job_records(cfg, trainer, bytes(32), None))
    records.setdefault("metrics", TrainingMetrics().to_record(0))
    store = Store.open(url)
    store.acquire_lease()
    ck = Checkpointer(store, async_write=True, keep_last=checkpoints)
    for _ in range(checkpoints):
        for _ in range(3):
            trainer.train_step()
        ck.save(trainer, dict(records))
    ck.close()
    out = []
    for v in store.versions():
        version = store.read(v, verify=True)  # every chunk and checksum verified
        out.append({n: (m.checksum, m.shape) for n, m in version.manifest.arrays.items()})
    return out


def test_snapshots_reuse_written_buffers_and_store_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[int] = []
    take = snapshot.BUFFERS.take

    def noting(shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        buf = take(shape, dtype)
        taken.append(id(buf))
        return buf

    monkeypatch.setattr(snapshot.BUFFERS, "take", noting)
    reused = _versions(str(tmp_path / "reused.zarr"), 3, taken)
    per_snapshot = len(taken) // 3
    assert per_snapshot > 0 and len(taken) == 3 * per_snapshot
    first, second = set(taken[:per_snapshot]), set(taken[per_snapshot : 2 * per_snapshot])
    assert first == second  # the second snapshot copied into the first's buffers

    monkeypatch.setattr(SnapshotBuffers, "recycle", lambda self, arrays: None)
    fresh = _versions(str(tmp_path / "fresh.zarr"), 3, [])
    assert len(reused) == 3
    assert reused == fresh
