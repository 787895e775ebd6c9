"""A user's real job (tests/cocoon_ckpt/real_job.py: a map-style Dataset read by two
DataLoader workers, StepLR, an EMA that updates itself, a physical batch of 8 under a
logical batch of 16) in real `cocoon-ckpt train` processes: SIGKILLed at random moments,
or SIGTERMed mid-run, then resumed, it ends bit for bit as the uninterrupted run (model,
optimizer, scheduler, EMA, noise ring, accountant)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt import JobConfig, run_job
from cocoon_ckpt.train.options import JobOptions
from state import Store

from . import real_job
from .conftest import job_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
#: Records that say how the run got there rather than what it holds; every other
#: record of the final version must equal the uninterrupted run's.
RUN_HISTORY = frozenset({"metrics"})


def _config() -> JobConfig:
    cfg = job_config("mlp", bands=4, steps=STEPS)
    return dataclasses.replace(
        cfg,
        job="tests.cocoon_ckpt.real_job:build",
        checkpoint_every=4,
        options={"step_sleep": 0.1},  # 2.4 s of steps: a signal after a commit lands mid-run
        dp=dataclasses.replace(cfg.dp, physical_batch_size=8),
    )


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted run (in this process) and the key file every run shares."""
    root = tmp_path_factory.mktemp("real-job")
    key, url = root / "noise.key", str(root / "gold.zarr")
    done = run_job(_config(), url, parts=real_job.build, options=JobOptions(key_file=str(key)))
    assert done.steps_done == STEPS and done.resumed_from is None
    return url, key


def _launch(tmp_path: Path, url: str, key: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`cocoon-ckpt train` of the real job in a fresh process; its stderr goes to a file
    (an orphaned DataLoader worker would hold a pipe open after a SIGKILL)."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_config().to_record()))
    err = tmp_path / f"{name}.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    cmd = [
        *(sys.executable, "-m", "cocoon_ckpt", "train", "--config", str(job)),
        *("--store", url, "--key-file", str(key), "--no-progress"),
    ]
    with err.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f)
    return proc, err


def _manifests(url: str) -> set[Path]:
    folder = Path(url) / "manifests"
    return set(folder.glob("*.json")) if folder.exists() else set()


def _wait_for_commit(proc: subprocess.Popen[bytes], url: str, why: str) -> None:
    """Until the process has committed a version of its own."""
    seen, deadline = _manifests(url), time.monotonic() + 120
    while not _manifests(url) - seen:
        assert proc.poll() is None, f"{why}: the job ended (rc {proc.returncode}) before a commit"
        assert time.monotonic() < deadline, f"{why}: no commit in 120 s"
        time.sleep(0.01)


def _assert_same_final(gold: str, url: str, why: str) -> None:
    """The newest versions of both stores hold the same arrays and records, bit for bit."""
    a, b = Store.open(gold, create=False).latest(), Store.open(url, create=False).latest()
    assert a is not None and b is not None, why
    assert a.step == b.step == STEPS, why
    assert sorted(a.array_names()) == sorted(b.array_names()), why
    for name in a.array_names():  # model, optimizer, EMA, noise ring, generator state
        x, y = a.array(name), b.array(name)
        assert x.dtype == y.dtype and x.shape == y.shape, f"{why}: {name}"
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{why}: {name} differs"
    assert {"scheduler", "stateful", "noise", "accountant", "trainer"} <= a.records.keys(), why
    for rec in a.records.keys() - RUN_HISTORY:  # scheduler, EMA count, noise head, epsilon
        assert a.records[rec] == b.records.get(rec), f"{why}: record {rec} differs"
    store = Store.open(url, create=False)
    for v in store.versions():
        store.read(v)  # every version left verifies


def test_sigkill_at_random_moments_then_resume_matches_uninterrupted(
    gold: tuple[str, Path], tmp_path: Path
) -> None:
    gold_url, key = gold
    url = str(tmp_path / "run.zarr")
    seed = int(os.environ.get("COCOON_KILL_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    log: list[str] = []

    def why() -> str:
        return f"kill seed {seed} (rerun with COCOON_KILL_SEED={seed}); {'; '.join(log)}"

    # kill 1: a moment drawn after the job's first commit (a step, a batch in the
    # DataLoader's workers, the next checkpoint write); 20 steps (2 s) remain
    proc, _ = _launch(tmp_path, url, key, "kill1")
    _wait_for_commit(proc, url, why())
    delay = rng.uniform(0.0, 0.4)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    latest = Store.open(url, create=False).latest()
    log.append(f"kill 1 {delay:.2f} s after a commit, at step {latest.step if latest else None}")
    assert proc.returncode == -signal.SIGKILL and latest is not None, why()

    # kill 2: a moment drawn from launch on (start-up, building the job and its workers,
    # the resume, the steps); start-up and the steps left take longer than 4 s
    proc, _ = _launch(tmp_path, url, key, "kill2")
    delay = rng.uniform(0.5, 4.0)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    latest = Store.open(url, create=False).latest()
    log.append(f"kill 2 at {delay:.2f} s, at step {latest.step if latest else None}")
    assert proc.returncode == -signal.SIGKILL, why()
    assert latest is not None and latest.step < STEPS, why()

    proc, err = _launch(tmp_path, url, key, "finish")
    assert proc.wait(timeout=300) == 0, f"{why()}: {err.read_text()}"
    _assert_same_final(gold_url, url, why())


def test_sigterm_mid_run_commits_releases_and_resumes_exactly(
    gold: tuple[str, Path], tmp_path: Path
) -> None:
    gold_url, key = gold
    url = str(tmp_path / "run.zarr")
    proc, err = _launch(tmp_path, url, key, "term")
    _wait_for_commit(proc, url, "SIGTERM run")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, err.read_text()
    text = err.read_text()
    assert text.count("\n") == 1 and text.startswith("cocoon-ckpt: stopped by SIGTERM"), text
    stopped = int(re.search(r"after step (\d+)", text).group(1))  # type: ignore[union-attr]
    store = Store.open(url, create=False)
    latest = store.latest()
    assert latest is not None and latest.step == stopped and 0 < stopped < STEPS
    holder = store.lease_holder()
    assert holder is not None and holder["released"]

    # resumed here (no --takeover: the lease was released), ends as the uninterrupted run
    done = run_job(_config(), url, parts=real_job.build, options=JobOptions(key_file=str(key)))
    assert done.resumed_from == stopped and done.steps_done == STEPS
    _assert_same_final(gold_url, url, f"stopped after step {stopped}")
