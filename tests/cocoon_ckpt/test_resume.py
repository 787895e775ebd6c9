"""I3 in-process: stop anywhere, resume from the store, end bit-identical."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt import ConfigMismatchError, NoiseKeyError, export_model, run_job
from cocoon_ckpt.dp.noise import check_generator_backend, generator_backend
from cocoon_ckpt.errors import GeneratorMismatchError
from cocoon_ckpt.format.ring_rows import slot_refs
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, crash_at, disarm_all
from state import Store

from .conftest import job_config


def _export(url: str, out: Path, **kw: Any) -> dict[str, torch.Tensor]:
    export_model(url, str(out), **kw)
    return torch.load(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("example", ["mlp", "dlrm"])
@pytest.mark.parametrize("bands", [1, 8])
def test_stop_and_resume_is_bit_identical(tmp_path: Path, example: str, bands: int) -> None:
    cfg = job_config(example, bands=bands, optimizer="adam", lr=0.01)
    key = str(tmp_path / "k")
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    gold = _export(str(tmp_path / "gold.zarr"), tmp_path / "gold.pt")
    url = str(tmp_path / "run.zarr")
    for stop in (3, 7, 12, 13, 21):  # between checkpoints: work since the last is redone
        run_job(cfg, url, stop_after=stop, options=JobOptions(key_file=key))
    res = run_job(cfg, url, options=JobOptions(key_file=key))
    assert res.resumed_from == 20
    got = _export(url, tmp_path / "got.pt")
    assert all(torch.equal(gold[k], got[k]) for k in gold)


def test_resume_on_memory_and_s3(store_location: dict[str, Any], tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=4, steps=12)
    key = str(tmp_path / "k")
    opts = store_location["storage_options"]
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    gold = _export(str(tmp_path / "gold.zarr"), tmp_path / "gold.pt")
    run_job(
        cfg,
        store_location["url"],
        stop_after=7,
        options=JobOptions(storage_options=opts, key_file=key),
    )
    run_job(cfg, store_location["url"], options=JobOptions(storage_options=opts, key_file=key))
    got = _export(store_location["url"], tmp_path / "got.pt", storage_options=opts)
    assert all(torch.equal(gold[k], got[k]) for k in gold)


@pytest.mark.parametrize(
    "point",
    [
        "checkpoint.after_arrays",
        "checkpoint.before_manifest",
        "checkpoint.after_manifest_temp",
        "checkpoint.after_array",
    ],
)
def test_crash_mid_commit_leaves_previous_version(tmp_path: Path, point: str) -> None:
    cfg = dataclasses.replace(job_config("mlp", bands=8), async_checkpoint=False)
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    crash_at(point, step=15)
    try:
        with pytest.raises(CrashPointHit):
            run_job(cfg, url, options=JobOptions(key_file=key))
    finally:
        disarm_all()
    store = Store.open(url, create=False)
    latest = store.latest()
    assert latest is not None and latest.step == 10  # the version of step 15 never appeared
    run_job(cfg, url, options=JobOptions(key_file=key))
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    a = _export(url, tmp_path / "a.pt")
    b = _export(str(tmp_path / "gold.zarr"), tmp_path / "b.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_changed_config_is_refused_with_every_difference(tmp_path: Path) -> None:
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    run_job(job_config("mlp", bands=8), url, stop_after=10, options=JobOptions(key_file=key))
    with pytest.raises(ConfigMismatchError) as err:
        run_job(job_config("mlp", bands=4, seed=3), url, options=JobOptions(key_file=key))
    assert any(d.startswith("dp.bands: stored 8, now 4") for d in err.value.differences)
    assert any(d.startswith("dp.seed") for d in err.value.differences)
    # harmless: cadence and retention may change
    harmless = dataclasses.replace(job_config("mlp", bands=8), checkpoint_every=3, keep_last=4)
    assert run_job(harmless, url, options=JobOptions(key_file=key)).steps_done == 24


def test_wrong_key_and_missing_key_are_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")
    run_job(job_config("mlp"), url, stop_after=5, options=JobOptions(key_file=str(tmp_path / "k1")))
    with pytest.raises(NoiseKeyError, match="k3 does not exist"):
        run_job(job_config("mlp"), url, options=JobOptions(key_file=str(tmp_path / "k3")))
    (tmp_path / "k2").write_bytes(bytes(range(32)))
    os.chmod(tmp_path / "k2", 0o600)  # a group-readable key file is refused first
    with pytest.raises(NoiseKeyError, match="does not match"):
        run_job(job_config("mlp"), url, options=JobOptions(key_file=str(tmp_path / "k2")))
    with pytest.raises(NoiseKeyError, match="no noise key"):
        run_job(job_config("mlp"), url)


def test_generator_backend_change_is_refused_unless_allowed() -> None:
    rec = {**generator_backend(), "torch": "0.0.1"}
    with pytest.raises(GeneratorMismatchError, match=r"ResumeAllowances\(generator_change=True\)"):
        check_generator_backend(rec)
    check_generator_backend(rec, allow_change=True)


def test_incremental_checkpoint_writes_only_new_slots(tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")
    cfg = dataclasses.replace(job_config("mlp", bands=16, steps=30), checkpoint_every=5)
    run_job(cfg, url, options=JobOptions(key_file=str(tmp_path / "k")))
    store = Store.open(url, create=False)
    v = store.latest()
    assert v is not None
    m = v.manifest
    # each slot by the array holding its row (the new slots of a version share one)
    refs = slot_refs(v.records["noise"]["shards"][0]["slots"])
    ring = {f"{r.array}#{r.row}": m.arrays[r.array] for r in refs}
    assert len(ring) == 15
    own = [k for k, a in ring.items() if a.path.startswith(f"versions/{m.version:08d}-")]
    assert len(own) == 5  # min(k, b-1) new slots; the rest referenced
    assert v.records["noise"]["shards"][0]["slots"]
    assert m.job_fingerprint == v.records["fingerprint"] and len(m.job_fingerprint) == 64
