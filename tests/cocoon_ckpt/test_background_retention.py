"""Retention after a commit runs on its own thread on a local store: the loop and the
next version's writes go on while retired versions are deleted, the next commit waits
for it, `wait` and `close` wait for it, and a crash halfway through its deletions
leaves a store that `retain` (gc) cleans and that resumes exactly."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt import open_job, run_job
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, Trace, golden, verify
from state import Store, hooks
from state.retention import BEFORE_DELETE

from .conftest import job_config


def _kept_steps(url: str) -> list[int]:
    store = Store.open(url, create=False)
    return [store.manifest(v).step for v in store.versions()]


def test_the_loop_and_the_next_write_go_on_while_retention_deletes(tmp_path: Path) -> None:
    cfg = job_config(bands=4, steps=30)
    url = str(tmp_path / "run.zarr")
    entered, release = threading.Event(), threading.Event()
    threads: set[str] = set()

    def hold(name: str, ctx: Mapping[str, Any]) -> None:
        threads.add(threading.current_thread().name)
        entered.set()
        if not release.wait(120):
            raise RuntimeError("the test never released retention")

    hooks.arm(BEFORE_DELETE, hold)
    try:
        with open_job(cfg, url, options=JobOptions(key_file=str(tmp_path / "k"))) as job:
            for _ in job.steps(until=20):
                pass  # versions at 5, 10, 15, 20: the one at 20 retires the one at 5
            assert entered.wait(120)
            for _ in job.steps(until=25):
                pass  # the loop was not held up; the version at 25 is written...
            time.sleep(0.5)
            assert _kept_steps(url)[-1] == 20  # ...but not committed before retention ends
            release.set()
            job.wait()
            assert _kept_steps(url) == [15, 20, 25]
            assert Store.open(url, create=False).space().unreachable == 0
    finally:
        release.set()
        hooks.disarm_all()
    assert threads and all(n.startswith("ckpt-retain") for n in threads)
    assert _kept_steps(url) == [15, 20, 25]


def test_close_waits_for_the_last_retention(tmp_path: Path) -> None:
    url = str(tmp_path / "run.zarr")
    slow: list[str] = []

    def lag(name: str, ctx: Mapping[str, Any]) -> None:
        time.sleep(0.05)
        slow.append(str(ctx["path"]))

    hooks.arm(BEFORE_DELETE, lag)
    try:
        run_job(
            job_config(bands=4, steps=20), url, options=JobOptions(key_file=str(tmp_path / "k"))
        )
    finally:
        hooks.disarm_all()
    assert slow
    assert _kept_steps(url) == [10, 15, 20]
    space = Store.open(url, create=False).space()
    assert space.unreachable == 0 and space.in_flight == 0


def test_a_crash_halfway_through_deletions_is_cleaned_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    cfg = job_config(bands=8, steps=24)
    key = str(tmp_path / "k")
    reference = golden(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    url = str(tmp_path / "run.zarr")
    hits: list[str] = []
    crashed = Trace()

    def second(name: str, ctx: Mapping[str, Any]) -> None:
        hits.append(ctx["what"])
        if len(hits) == 2:  # the retired manifest is gone, its arrays not yet
            raise CrashPointHit(name, dict(ctx))

    hooks.arm(BEFORE_DELETE, second)
    try:
        with pytest.raises(CrashPointHit):
            run_job(cfg, url, on_step=crashed.record, options=JobOptions(key_file=key))
    finally:
        hooks.disarm_all()
    assert hits[0] == "manifest" and hits[1] != "manifest"
    store = Store.open(url, create=False)
    assert _kept_steps(url) == [10, 15, 20]  # the next commit was stopped by the crash
    assert store.space().unreachable > 0
    store.acquire_lease()
    try:
        assert store.retain(keep_last=3)
    finally:
        store.release_lease()
    assert Store.open(url, create=False).space().unreachable == 0
    _, divergence = verify(cfg, url, [], reference, crashed, options=JobOptions(key_file=key))
    assert divergence is None, str(divergence)
    assert Store.open(url, create=False).latest().records["complete"]  # type: ignore[union-attr]


def test_a_job_shortens_the_switch_interval_while_it_writes_and_restores_it(
    tmp_path: Path,
) -> None:
    from cocoon_ckpt.examples import mlp as mlp_job
    from cocoon_ckpt.train.checkpoint import WRITER_SWITCH_INTERVAL

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        cfg = job_config(bands=4, steps=6)
        with open_job(cfg, str(tmp_path / "a.zarr"), mlp_job.build(cfg)) as job:
            assert sys.getswitchinterval() == pytest.approx(WRITER_SWITCH_INTERVAL)
            list(job.steps())
        assert sys.getswitchinterval() == pytest.approx(0.005)
        # a shorter one is left alone; one changed meanwhile is not put back
        sys.setswitchinterval(0.0001)
        with open_job(cfg, str(tmp_path / "b.zarr"), mlp_job.build(cfg)) as job:
            assert sys.getswitchinterval() == pytest.approx(0.0001)
        sys.setswitchinterval(0.005)
        with open_job(cfg, str(tmp_path / "c.zarr"), mlp_job.build(cfg)) as job:
            sys.setswitchinterval(0.002)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        # a job writing in the foreground has no writer thread to hand over to
        fg = job_config(bands=4, steps=6, async_checkpoint=False)
        with open_job(fg, str(tmp_path / "d.zarr"), mlp_job.build(fg)) as job:
            assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(before)


_EXIT_IN_FLIGHT = """
import sys, time
from cocoon_ckpt import DPConfig, JobConfig, JobOptions, open_job
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.checkpoint import ASYNC_FLUSH
from state import hooks

url, key = sys.argv[1], sys.argv[2]
dp = DPConfig(steps=12, batch_size=16, dataset_size=512, noise_multiplier=1.0, bands=4)
cfg = JobConfig(job="example:mlp", dp=dp, checkpoint_every=5)
job = open_job(cfg, url, mlp.build(cfg), options=JobOptions(key_file=key))
for _ in job.steps(until=7):
    pass
# the writer of step 7 starts only after the main thread has returned
hooks.arm(ASYNC_FLUSH, lambda name, ctx: time.sleep(1.0) if ctx["step"] == 7 else None)
job.checkpoint()
print("exiting with a checkpoint in flight", flush=True)
"""


def test_a_checkpoint_in_flight_when_the_interpreter_exits_is_committed(tmp_path: Path) -> None:
    """A job never closed: its last checkpoint is written while the interpreter exits,
    when every thread pool refuses new work (the fsyncs, retention and epsilon run in
    the writer's thread then)."""
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_IN_FLIGHT, url, key],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "exiting with a checkpoint in flight" in done.stdout
    assert _kept_steps(url) == [5, 7], done.stderr
    newest = Store.open(url, create=False).latest()  # its arrays verify
    assert newest is not None and newest.step == 7
