"""faulty:// against the store and the job: transient faults are absorbed, permanent
ones are clear errors that leave the store openable, at-rest damage is always found."""

from __future__ import annotations

import errno
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from cocoon_ckpt import export_model, run_job
from cocoon_ckpt.train.options import JobOptions
from fault_injection import FaultPlan, faulty_filesystem
from state import CorruptVersionError, Store

from ..cocoon_ckpt.conftest import job_config


def _url() -> str:
    return f"/faulty-{uuid.uuid4().hex}"


def test_transient_and_lost_responses_are_absorbed_and_resume_is_exact(tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=8, steps=16)
    key = str(tmp_path / "k")
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    export_model(str(tmp_path / "gold.zarr"), str(tmp_path / "gold.pt"))
    fs = faulty_filesystem(
        "memory://", FaultPlan(seed=3, transient=0.2, lost_response=0.1, slow=0.05)
    )
    url = _url()
    run_job(cfg, url, stop_after=9, options=JobOptions(fs=fs, key_file=key))
    run_job(cfg, url, options=JobOptions(fs=fs, key_file=key))
    assert fs.injected["transient"] > 5 and fs.injected["lost_response"] > 0
    fs.armed = False
    latest = Store.open(url, fs=fs, create=False).latest()
    assert latest is not None and latest.records["complete"]
    gold = torch.load(tmp_path / "gold.pt")
    for name, arr in gold.items():
        assert torch.equal(torch.from_numpy(latest.array(f"model/{name}")), arr)


def test_permanent_error_is_clear_and_the_store_stays_openable(tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=4, steps=20)
    url = _url()
    fs = faulty_filesystem("memory://", FaultPlan(seed=0))
    run_job(cfg, url, stop_after=10, options=JobOptions(fs=fs, key_file=str(tmp_path / "k")))
    broken = faulty_filesystem("memory://", FaultPlan(seed=0, permanent_after=0))
    with pytest.raises(OSError, match="permanent I/O error") as err:
        run_job(
            cfg, url, options=JobOptions(fs=broken, key_file=str(tmp_path / "k"), takeover=True)
        )
    assert err.value.errno == errno.EIO
    latest = Store.open(url, fs=fs, create=False).latest()
    assert latest is not None and latest.step == 10


def test_full_disk_is_enospc_and_the_last_version_survives(tmp_path: Path) -> None:
    store_url = _url()
    fs = faulty_filesystem("memory://", FaultPlan(seed=0, capacity_bytes=200_000))
    store = Store.open(store_url, fs=fs)
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("a", np.zeros(1000))
    txn.commit()
    txn = store.begin(2)
    with pytest.raises(OSError, match="No space left") as err:
        txn.put_array("b", np.zeros(100_000))
    assert err.value.errno == errno.ENOSPC
    latest = store.latest()
    assert latest is not None and latest.version == 1


@pytest.mark.parametrize("kind", ["torn", "lost", "flip_rest"])
def test_every_at_rest_corruption_is_detected(kind: str) -> None:
    plan = FaultPlan(seed=11, paths=("/c.",), **{kind: 0.15})
    fs = faulty_filesystem("memory://", plan)
    url = _url()
    store = Store.open(url, fs=fs)
    store.acquire_lease()
    rng = np.random.default_rng(0)
    for step in range(1, 25):
        txn = store.begin(step)
        for i in range(3):
            txn.put_array(f"ring/w-{i}", rng.standard_normal(5000))
        txn.commit()
    fs.armed = False
    damaged = {int(m.group(1)) for _, p in fs.log if (m := re.search(r"versions/(\d{8})-", p))}
    assert damaged, "the plan injected nothing; raise the probability"
    failed = set()
    for v in store.versions():
        try:
            store.read(v)
        except CorruptVersionError as exc:
            assert exc.version == v and "/c." in exc.path + str(exc)
            failed.add(v)
    assert failed == damaged  # every damaged version found, no false alarm


def test_bit_flips_on_read_are_detected() -> None:
    fs = faulty_filesystem("memory://", FaultPlan(seed=5))
    url = _url()
    store = Store.open(url, fs=fs)
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("ring/w", np.arange(4000, dtype=np.float64))
    txn.commit()
    flipping = faulty_filesystem("memory://", FaultPlan(seed=5, flip_read=1.0, paths=("/c.",)))
    with pytest.raises(CorruptVersionError, match="crc32c"):
        Store.open(url, fs=flipping, create=False).latest()
