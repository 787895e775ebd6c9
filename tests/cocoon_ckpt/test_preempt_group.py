"""Preemption as schedulers send it: SIGTERM or SIGINT to the job's whole process group,
its DataLoader workers included (SLURM's scancel, Kubernetes, Ctrl-C at a terminal).

A user's real job (tests/cocoon_ckpt/real_job.py: a map-style Dataset read by two
DataLoader workers) runs as `cocoon-ckpt train` in a session of its own; the signal
goes to the group once the job has committed a version. The job finishes its step,
commits it in the foreground, releases the lease and exits 143 (130); the rerun (no
--takeover) ends bit for bit as the uninterrupted run. A worker stopped by SIGSTOP is
named (its pid) after the job's worker timeout, and the lease is released; a signal
while the lease is being taken still releases it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cocoon_ckpt import JobConfig, run_job
from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.data import make_loader
from cocoon_ckpt.train.options import JobOptions
from state import Store

from . import real_job
from .test_real_job_kill import _assert_same_final
from .test_real_job_kill import _config as real_job_kill_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
#: Seconds a step waits for a worker's batch here: short, so the stopped worker is named
#: soon, and long beside a batch of 16 rows from a loaded machine's worker.
WORKER_TIMEOUT_S = 5.0


def _config() -> JobConfig:
    """test_real_job_kill's job, its workers watched with a short timeout."""
    cfg = real_job_kill_config()
    return dataclasses.replace(cfg, options={**cfg.options, "worker_timeout_s": WORKER_TIMEOUT_S})


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The uninterrupted run (in this process) and the key file every run shares."""
    root = tmp_path_factory.mktemp("group")
    key, url = root / "noise.key", str(root / "gold.zarr")
    done = run_job(_config(), url, parts=real_job.build, options=JobOptions(key_file=str(key)))
    assert done.steps_done == STEPS and done.resumed_from is None
    return url, key


def _train(
    tmp_path: Path, url: str, key: Path, name: str, prelude: str = ""
) -> tuple[subprocess.Popen[bytes], Path]:
    """`cocoon-ckpt train` of the real job in a session (and process group) of its own,
    stderr to a file; `prelude` runs first in that process (a patch)."""
    job = tmp_path / "job.json"
    job.write_text(json.dumps(_config().to_record()))
    err = tmp_path / f"{name}.err"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    args = ["train", "--config", str(job), "--store", url, "--key-file", str(key), "--no-progress"]
    code = (
        f"{prelude}\nimport sys\nfrom cocoon_ckpt._cli.main import main\nsys.exit(main({args!r}))"
    )
    with err.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=f,
            start_new_session=True,
        )
    return proc, err


def _wait_for_commit(proc: subprocess.Popen[bytes], url: str, err: Path) -> None:
    folder = Path(url) / "manifests"
    deadline = time.monotonic() + 120
    while not (folder.exists() and any(folder.glob("*.json"))):
        assert proc.poll() is None, (
            f"ended (rc {proc.returncode}) before a commit: {err.read_text()}"
        )
        assert time.monotonic() < deadline, "no commit in 120 s"
        time.sleep(0.01)


def _workers(pid: int) -> list[int]:
    """The job's DataLoader workers: its child processes."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        children += [int(c) for c in text.split()]
    return children


def _wait_group_gone(pgid: int) -> None:
    """Until no process of the group is left (the workers end with the job)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"process group {pgid} still has processes"
        time.sleep(0.01)


def _assert_released(url: str) -> None:
    holder = Store.open(url, create=False).lease_holder()
    assert holder is not None and holder["released"], holder


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_checkpoints_releases_and_resumes_exactly(
    gold: tuple[str, Path], tmp_path: Path, sig: signal.Signals
) -> None:
    gold_url, key = gold
    url = str(tmp_path / "run.zarr")
    proc, err = _train(tmp_path, url, key, "group")
    _wait_for_commit(proc, url, err)
    assert len(_workers(proc.pid)) == 2  # the workers run, in the job's group
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=120) == 128 + sig, err.read_text()
    text = err.read_text()
    assert text.count("\n") == 1 and text.startswith(f"cocoon-ckpt: stopped by {sig.name}"), text
    stopped = int(re.search(r"after step (\d+)", text).group(1))  # type: ignore[union-attr]
    latest = Store.open(url, create=False).latest()
    assert latest is not None and latest.step == stopped and 0 < stopped < STEPS, text
    _assert_released(url)
    _wait_group_gone(proc.pid)

    # a new writer starts without --takeover and ends as the uninterrupted run
    proc, err = _train(tmp_path, url, key, "resume")
    assert proc.wait(timeout=300) == 0, err.read_text()
    _assert_same_final(gold_url, url, f"{sig.name} to the group after step {stopped}")


def test_a_stopped_worker_is_named_and_the_lease_released(
    gold: tuple[str, Path], tmp_path: Path
) -> None:
    gold_url, key = gold
    url = str(tmp_path / "run.zarr")
    proc, err = _train(tmp_path, url, key, "stop")
    _wait_for_commit(proc, url, err)
    committed = {v: Store.open(url, create=False).read(v).step for v in Store.open(url).versions()}
    worker = _workers(proc.pid)[0]
    os.kill(worker, signal.SIGSTOP)
    assert proc.wait(timeout=120) == 3, err.read_text()
    text = err.read_text()
    assert text.count("\n") == 1, text
    assert f"(pid {worker}) is stopped" in text and "rerun the same command" in text, text
    assert f"waited {WORKER_TIMEOUT_S:g} s" in text and "lease is released" in text, text
    _assert_released(url)
    _wait_group_gone(proc.pid)  # the stopped worker was killed, not left behind
    store = Store.open(url, create=False)
    for v, step in committed.items():
        assert store.read(v).step == step  # what was committed before is kept

    # the rerun (no --takeover) resumes and ends as the uninterrupted run
    proc, err = _train(tmp_path, url, key, "resume")
    assert proc.wait(timeout=300) == 0, err.read_text()
    _assert_same_final(gold_url, url, "resumed after a stopped worker")


def test_a_killed_worker_is_named_at_once_and_the_lease_released(
    gold: tuple[str, Path], tmp_path: Path
) -> None:
    _, key = gold
    url = str(tmp_path / "run.zarr")
    proc, err = _train(tmp_path, url, key, "kill")
    _wait_for_commit(proc, url, err)
    committed = {v: Store.open(url, create=False).read(v).step for v in Store.open(url).versions()}
    worker = _workers(proc.pid)[1]
    os.kill(worker, signal.SIGKILL)  # the kernel's OOM killer, say
    assert proc.wait(timeout=120) == 3, err.read_text()
    text = err.read_text()
    assert text.count("\n") == 1, text
    assert f"(pid {worker}) was killed by SIGKILL" in text and "lease is released" in text, text
    assert "rerun the same command to resume" in text, text
    _assert_released(url)
    _wait_group_gone(proc.pid)
    store = Store.open(url, create=False)
    for v, step in committed.items():
        assert store.read(v).step == step


#: Run in the job's process: the group's SIGTERM arrives inside `acquire_lease`, after
#: the lease record is created and before the store holds it (the heartbeat's start).
SIGNAL_IN_LEASE = """
import os, signal
from state import lease

start = lease.Lease.start_heartbeat

def start_heartbeat(self):
    os.killpg(0, signal.SIGTERM)
    start(self)

lease.Lease.start_heartbeat = start_heartbeat
"""


def test_a_signal_while_the_lease_is_taken_releases_it(
    gold: tuple[str, Path], tmp_path: Path
) -> None:
    _, key = gold
    url = str(tmp_path / "run.zarr")
    proc, err = _train(tmp_path, url, key, "lease", prelude=SIGNAL_IN_LEASE)
    assert proc.wait(timeout=120) == 143, err.read_text()
    text = err.read_text()
    assert text.count("\n") == 1, text
    assert text.startswith("cocoon-ckpt: stopped by SIGTERM before a checkpoint"), text
    leases = sorted(p.name for p in (Path(url) / "leases").iterdir())
    assert leases == ["00000001.json", "00000001.released"], leases
    _assert_released(url)
    assert not (Path(url) / "manifests").exists() or not any((Path(url) / "manifests").iterdir())


def _note_worker(folder: Path, worker_id: int) -> None:
    """A user's worker_init_fn: records that it ran and the worker's SIGTERM handler."""
    ignored = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    (folder / f"worker-{worker_id}").write_text(json.dumps({"sigterm_ignored": ignored}))


def test_workers_keep_the_users_worker_init_fn_and_the_same_batches(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 5, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    data = real_job.Pairs(x, y)
    sampler = CyclicPoissonSampler(dataset_size=64, batch_size=8, bands=2, seed=11)
    alone = list(make_loader(data, sampler, start=0, steps=10))
    init = functools.partial(_note_worker, tmp_path)
    loader = make_loader(data, sampler, start=0, steps=10, num_workers=2, worker_init_fn=init)
    pooled = list(loader)
    assert [b.step for b in pooled] == list(range(10))
    for a, b in zip(alone, pooled, strict=True):
        assert torch.equal(a.indices, b.indices)
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors, strict=True))
    for worker_id in (0, 1):
        seen = json.loads((tmp_path / f"worker-{worker_id}").read_text())
        assert seen == {"sigterm_ignored": True}
    # this process's handler is untouched
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN


def test_chaos_sends_the_process_group_sigterm_and_finds_nothing_wrong(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`cocoon-ckpt chaos`'s subprocess trials: each is sent SIGTERM to its whole group
    once, at a random moment; every outcome is exit 143 with the named step committed,
    or a death before the handlers, never a lease left held or a lost step."""
    from cocoon_ckpt._cli.main import main

    code = main(
        [
            *("chaos", "--trials", "1", "--kill-trials", "2", "--takeover-trials", "0"),
            *("--steps", "40", "--seed", "3", "--json"),
        ]
    )
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["ok"] and report["failures"] == [], report
    assert report["kill_trials"] == 2 and report["divergences"] == 0, report


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), "5"])
def test_a_worker_timeout_that_is_not_a_positive_finite_number_is_refused_by_name(
    bad: object,
) -> None:
    parts = real_job.build(_config())
    with pytest.raises(ConfigError, match=r"JobParts\.worker_timeout_s=.* must be a finite number"):
        dataclasses.replace(parts, worker_timeout_s=bad)
