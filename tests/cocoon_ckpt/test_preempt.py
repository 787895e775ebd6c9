"""Preemption: SIGTERM / SIGINT finish the step, commit it, release the lease, exit
143 / 130 with one line; the resumed job ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cocoon_ckpt import DPTrainer, JobConfig, StepResult, run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.errors import PreemptedError
from cocoon_ckpt.examples import mlp as mlp_job
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import Store

from .conftest import job_config

#: A job module for the subprocess: the mlp example whose optimizer waits 50 ms per
#: step, so a signal sent after the first commit lands mid-run on any machine.
SLOW_JOB = """
import time
from cocoon_ckpt.examples import mlp

def build(config):
    parts = mlp.build(config)
    step = parts.optimizer.step

    def slow_step(*args, **kwargs):
        time.sleep(0.05)
        return step(*args, **kwargs)

    parts.optimizer.step = slow_step
    return parts
"""

STEPS = 20


def _fast_build(config: JobConfig) -> JobParts:
    """The same job as SLOW_JOB without the wait (the job name is only a name)."""
    return mlp_job.build(config)


def _config() -> JobConfig:
    return dataclasses.replace(job_config(bands=4, steps=STEPS), job="slowjob:build")


def _model(url: str) -> dict[str, torch.Tensor]:
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    return {n: torch.from_numpy(latest.array(n)) for n in latest.array_names() if "model/" in n}


def test_sigterm_mid_run_commits_the_step_releases_the_lease_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    (tmp_path / "slowjob.py").write_text(SLOW_JOB)
    key, url = tmp_path / "noise.key", str(tmp_path / "run.zarr")
    cmd = [
        *(sys.executable, "-m", "cocoon_ckpt", "train", "--config", str(tmp_path / "job.json")),
        *("--store", url, "--key-file", str(key), "--no-progress"),
    ]
    (tmp_path / "job.json").write_text(json.dumps(_config().to_record()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "run.zarr" / "manifests").glob("*.json")):  # first commit
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.count("\n") == 1 and err.startswith("cocoon-ckpt: stopped by SIGTERM"), err
    stopped = int(re.search(r"after step (\d+)", err).group(1))  # type: ignore[union-attr]
    store = Store.open(url, create=False)
    latest = store.latest()
    assert latest is not None and latest.step == stopped and 0 < stopped < STEPS
    holder = store.lease_holder()
    assert holder is not None and holder["released"]

    # resume (no --takeover needed: the lease was released) and compare with a run
    # that was never stopped, both with the same key
    resumed = run_job(_config(), url, parts=_fast_build, options=JobOptions(key_file=str(key)))
    assert resumed.resumed_from == stopped and resumed.steps_done == STEPS
    gold = str(tmp_path / "gold.zarr")
    run_job(_config(), gold, parts=_fast_build, options=JobOptions(key_file=str(key)))
    a, b = _model(url), _model(gold)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigint_in_the_loop_finishes_the_step_and_checkpoints_it(tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")

    def interrupt(res: StepResult, trainer: DPTrainer) -> None:
        if res.step == 6:  # during step 7 of 24: noted, the step finishes
            os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(PreemptedError, match="stopped by SIGINT after step 7") as info:
        run_job(job_config(bands=4), url, on_step=interrupt)
    assert info.value.signum == signal.SIGINT and info.value.step == 7
    store = Store.open(url, create=False)
    latest = store.latest()
    assert latest is not None and latest.step == 7 and info.value.version == latest.version
    assert store.lease_holder()["released"]  # type: ignore[index]
    # handlers restored to what the process had (SIG_IGN where a shell started it in the
    # background, the default handler otherwise)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_before_training_stops_at_once_and_writes_nothing(tmp_path: Path) -> None:
    def build(config: JobConfig) -> JobParts:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the job is being set up
        return mlp_job.build(config)

    with pytest.raises(PreemptedError, match="stopped by SIGTERM before a checkpoint"):
        run_job(job_config(bands=4), str(tmp_path / "s.zarr"), parts=build)
    assert list(tmp_path.iterdir()) == []


def test_cli_maps_sigint_to_exit_130_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "slowjob.py").write_text(SLOW_JOB)
    monkeypatch.syspath_prepend(str(tmp_path))
    url = str(tmp_path / "s.zarr")

    def send() -> None:
        while not list((tmp_path / "s.zarr" / "manifests").glob("*.json")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()
    code = main(
        [
            *("train", "--job", "slowjob:build", "--store", url, "--steps", str(STEPS)),
            *("--checkpoint-every", "2", "--bands", "4", "--batch-size", "16"),
            *("--dataset-size", "512", "--no-progress"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 130 and err.count("\n") == 1 and "stopped by SIGINT after step" in err
    latest = Store.open(url, create=False).latest()
    assert latest is not None and f"after step {latest.step};" in err
