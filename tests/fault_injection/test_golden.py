"""Every crash point, hit for real: what the store holds right after the crash, and
the golden comparator's verdict on the resumed run."""

from __future__ import annotations

from pathlib import Path

import pytest

from cocoon_ckpt import run_job
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, Trace, crash_at, disarm_all, golden, verify
from state import Store, hooks

from ..cocoon_ckpt.conftest import job_config

# (crash point, step it is armed at, step of the newest version right after the crash)
CASES = [
    ("noise.before_fresh", 7, 5),
    ("noise.after_fresh", 7, 5),
    ("noise.after_gemv", 7, 5),
    ("trainer.after_update", 7, 5),
    ("checkpoint.async_flush", 10, 5),
    ("checkpoint.before_array", 10, 5),
    ("checkpoint.after_array", 10, 5),
    ("checkpoint.after_arrays", 10, 5),
    ("checkpoint.before_manifest", 10, 5),
    ("checkpoint.after_manifest_temp", 10, 5),
    ("checkpoint.after_manifest", 10, 10),
    ("retention.before_delete", None, 20),  # first deletion: the 4th version, step 20
]


# Fires only in multi-process jobs; tests/cocoon_ckpt/test_distributed.py SIGKILLs a rank
# there and checks the previous version stays newest and a restart resumes exactly.
MULTI_PROCESS_ONLY = {"checkpoint.shard_done"}

# Fires only in a coalesced embedding job's precompute (this job has no tables);
# tests/cocoon_ckpt/test_precompute_resume.py crashes there, in-process and SIGKILLed.
PRECOMPUTE_ONLY = {"precompute.after_tile", "precompute.tile_kept"}


def test_cases_cover_every_known_point() -> None:
    covered = {c[0] for c in CASES} | MULTI_PROCESS_ONLY | PRECOMPUTE_ONLY
    assert covered == set(hooks.KNOWN_POINTS)


@pytest.mark.parametrize(("point", "step", "newest"), CASES)
def test_crash_point_store_state_and_exact_resume(
    tmp_path: Path, point: str, step: int | None, newest: int
) -> None:
    cfg = job_config("mlp", bands=8, steps=24)
    key = str(tmp_path / "k")
    reference = golden(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    url = str(tmp_path / "run.zarr")
    crashed = Trace()
    crash_at(point, step=step)
    try:
        with pytest.raises(CrashPointHit):
            run_job(cfg, url, on_step=crashed.record, options=JobOptions(key_file=key))
    finally:
        disarm_all()
    store = Store.open(url, create=False)
    latest = store.latest()  # verifies every array of the newest version
    assert latest is not None and latest.step == newest
    for v in store.versions():
        store.read(v)  # nothing half-written is visible
    trace, divergence = verify(cfg, url, [], reference, crashed, options=JobOptions(key_file=key))
    assert divergence is None, str(divergence)
    assert Store.open(url, create=False).latest().records["complete"]  # type: ignore[union-attr]


def test_verify_runs_a_crash_schedule_and_finds_no_divergence(tmp_path: Path) -> None:
    cfg = job_config("dlrm", bands=8, steps=24)
    key = str(tmp_path / "k")
    reference = golden(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    schedule = [
        ("checkpoint.after_arrays", 5),
        ("noise.after_gemv", 13),
        ("trainer.after_update", 22),
    ]
    trace, divergence = verify(
        cfg, str(tmp_path / "run.zarr"), schedule, reference, options=JobOptions(key_file=key)
    )
    assert divergence is None, str(divergence)
    assert trace.crashes == [
        "checkpoint.after_arrays@5",
        "noise.after_gemv@13",
        "trainer.after_update@22",
    ]
    assert sorted(trace.steps) == list(range(24))


def test_a_wrong_resume_is_reported_at_its_first_step(tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=8, steps=12)
    reference = golden(
        cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=str(tmp_path / "k1"))
    )
    other = golden(
        cfg, str(tmp_path / "other.zarr"), options=JobOptions(key_file=str(tmp_path / "k2"))
    )
    div = reference.first_divergence(other)
    assert div is not None and div.step == 0 and "noise" in div.fields and "batch" not in div.fields
