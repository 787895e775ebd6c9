"""The user's own loop (`open_job`; the README's example runs in tests/docs/): a stop
then a resume through the API ends bit-identical to an uninterrupted run; a store written by it is as
complete as run_job's (inspect, diff, gc, audit, export); SIGINT in the loop and
SIGKILL of a process running the loop both resume exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cocoon_ckpt import JobConfig, StepResult, open_job, run_job
from cocoon_ckpt.errors import PreemptedError
from cocoon_ckpt.examples import mlp as mlp_job
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.catalog import collect_garbage, diff_versions, inspect_store
from cocoon_ckpt.tools.export import export_model
from cocoon_ckpt.train.job_records import REQUIRED, IncompleteRecordsError, check_job_records
from cocoon_ckpt.train.options import JobOptions
from state import Store, StoreError

from .conftest import job_config

ROOT = Path(__file__).resolve().parents[2]


def _model(url: str) -> dict[str, torch.Tensor]:
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    return {n: torch.from_numpy(latest.array(n)) for n in latest.array_names() if "model/" in n}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loop(config: JobConfig, url: str, key: str, stop: int | None = None) -> int:
    """The user's loop over the mlp example: break after step `stop` (1-based count)."""
    with open_job(config, url, mlp_job.build(config), options=JobOptions(key_file=key)) as job:
        for res in job.steps():
            assert res.step == job.step - 1
            if stop is not None and job.step == stop:
                break
        return job.step


def test_stop_then_resume_through_the_api_is_bit_identical(tmp_path: Path) -> None:
    cfg, key = job_config(bands=4), str(tmp_path / "noise.key")
    gold, url = str(tmp_path / "gold.zarr"), str(tmp_path / "run.zarr")
    run_job(cfg, gold, options=JobOptions(key_file=key))
    assert _loop(cfg, url, key, stop=7) == 7  # 7 is off the cadence (every 5)
    assert Store.open(url, create=False).latest().step == 7  # type: ignore[union-attr]
    with open_job(cfg, url, mlp_job.build(cfg), options=JobOptions(key_file=key)) as job:
        assert job.resumed_from == 7 and job.step == 7
        for _ in job.steps(until=13):
            pass
        assert job.step == 13
        for _ in job.steps():
            pass
        assert job.done
    assert _same(_model(url), _model(gold))


def test_an_early_stop_leaves_a_store_every_tool_reads(tmp_path: Path) -> None:
    cfg, key = job_config(bands=4), str(tmp_path / "noise.key")
    url = str(tmp_path / "run.zarr")
    _loop(cfg, url, key, stop=12)
    store = Store.open(url, create=False)
    for v in store.versions():
        check_job_records(store.manifest(v).records)  # every job record, in every version
    info = inspect_store(url)
    assert info["job"] is not None and info["versions"][-1]["step"] == 12
    with pytest.raises(StoreError, match="the job is at step 12 of 24"):
        export_model(url, str(tmp_path / "m.pt"))
    report = export_model(url, str(tmp_path / "m.pt"), allow_incomplete=True)
    assert report["epsilon"] > 0
    versions = store.versions()
    assert diff_versions(url, versions[0], versions[-1])
    assert audit_store(url, coordinates=64, seed=0, key_file=key).ok
    collect_garbage(url, keep=2)
    _loop(cfg, url, key)  # and the job resumes to its end
    assert Store.open(url, create=False).latest().step == 24  # type: ignore[union-attr]


def test_missing_job_records_are_refused_with_their_names() -> None:
    with pytest.raises(IncompleteRecordsError, match="config, fingerprint.*open_job"):
        check_job_records({"complete": False})
    assert {"config", "fingerprint", "key_id", "model_shapes"} <= set(REQUIRED)


def test_checkpointer_refuses_a_version_without_job_records(tmp_path: Path) -> None:
    from cocoon_ckpt import Checkpointer
    from cocoon_ckpt.train.build import build_trainer

    cfg = job_config(bands=2, steps=4)
    trainer = build_trainer(cfg, b"k" * 32)
    store = Store.open(str(tmp_path / "low.zarr"))
    store.acquire_lease()
    ckpt = Checkpointer(store, async_write=False)
    try:
        trainer.train_step()
        with pytest.raises(IncompleteRecordsError, match="open_job"):
            ckpt.save(trainer, {})
        assert store.versions() == []
    finally:
        ckpt.close()
        trainer.close()
        store.release_lease()


def test_sigint_in_the_loop_checkpoints_the_step_and_releases_the_lease(tmp_path: Path) -> None:
    cfg, url = job_config(bands=4), str(tmp_path / "s.zarr")
    before = signal.getsignal(signal.SIGINT)
    seen: list[StepResult] = []
    with (
        pytest.raises(PreemptedError, match="stopped by SIGINT after step 7") as info,
        open_job(cfg, url) as job,
    ):
        for res in job.steps():
            seen.append(res)
            if res.step == 6:  # noted; the loop stops before step 8
                os.kill(os.getpid(), signal.SIGINT)
    assert len(seen) == 7 and info.value.step == 7
    store = Store.open(url, create=False)
    assert store.latest().step == 7  # type: ignore[union-attr]
    assert store.lease_holder()["released"]  # type: ignore[index]
    # handlers restored to what the process had (SIG_IGN where a shell started it in the
    # background, the default handler otherwise)
    assert signal.getsignal(signal.SIGINT) is before


#: The user's loop in a process of its own; the optimizer waits 30 ms a step so a kill
#: after the first commit lands mid-run.
KILLED_LOOP = """
import sys, time
from cocoon_ckpt import JobConfig, JobOptions, open_job
from cocoon_ckpt.examples import mlp

config = JobConfig.from_record(__import__("json").loads(sys.argv[3]))
parts = mlp.build(config)
step = parts.optimizer.step

def slow_step(*args, **kwargs):
    time.sleep(0.03)
    return step(*args, **kwargs)

parts.optimizer.step = slow_step
with open_job(config, sys.argv[1], parts, options=JobOptions(key_file=sys.argv[2])) as job:
    for res in job.steps():
        pass
"""


@pytest.mark.slow
def test_sigkill_of_a_user_loop_then_resume_matches_uninterrupted(tmp_path: Path) -> None:
    cfg = job_config(bands=4, steps=30)
    key, url = str(tmp_path / "noise.key"), str(tmp_path / "run.zarr")
    script = tmp_path / "loop.py"
    script.write_text(KILLED_LOOP)
    cmd = [sys.executable, str(script), url, key, json.dumps(cfg.to_record())]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list((tmp_path / "run.zarr" / "manifests").glob("*.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    time.sleep(0.2)  # between checkpoints, or inside one
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    latest = Store.open(url, create=False).latest()
    assert latest is not None and latest.step < 30
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    gold = str(tmp_path / "gold.zarr")
    run_job(cfg, gold, options=JobOptions(key_file=key))
    assert _same(_model(url), _model(gold))


def test_digits_example_runs(tmp_path: Path) -> None:
    store = str(tmp_path / "digits.zarr")
    cmd = [sys.executable, str(ROOT / "examples" / "digits" / "run.py"), store, "--epochs", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "epoch 1: loss" in done.stdout and "test accuracy" in done.stdout
    assert (tmp_path / "digits.zarr.pt").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "epoch" not in again.stdout  # finished: nothing to take
