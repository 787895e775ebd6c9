"""A job's gradients run at its recorded torch thread count, so a resume on another
machine size (or with OMP_NUM_THREADS set) stays bit-identical, and a new job's default
count is the rule by dense size (one thread below `ONE_THREAD_BELOW`), which a resume of
a store written under another default never reapplies (`train.grad_threads`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt import ConfigMismatchError, DPConfig, DPTrainer, JobConfig, run_job
from cocoon_ckpt.embedding import EmbeddingConfig
from cocoon_ckpt.embedding.one_thread import fixed_threads
from cocoon_ckpt.format.stored import model_state, records_of
from cocoon_ckpt.train import grad_threads as grad_threads_mod
from cocoon_ckpt.train import job_records as job_records_mod
from cocoon_ckpt.train import session, start
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.job_records import REQUIRED, job_records
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.runner import build_trainer
from state import Store

from .conftest import job_config

KEY = bytes(32)

# Poisson batches of expected size 8: most steps draw 5-11 examples, the sizes at which
# the MLP's per-sample GEMMs give other bits on 1 and 2 threads (checked below)
CFG = JobConfig(
    job="example:mlp",
    dp=DPConfig(steps=12, batch_size=8, dataset_size=512, noise_multiplier=1.0, bands=4, seed=0),
    checkpoint_every=5,
)
# the same job with the count asked for: the uninterrupted 2-thread runs compared against
CFG2 = dataclasses.replace(CFG, grad_threads=2)

RESUME = """
import json, sys, torch
torch.set_num_threads(1)
from cocoon_ckpt import JobConfig, JobOptions, run_job
cfg = JobConfig.from_record(json.loads(sys.argv[1]))
run_job(cfg, sys.argv[2], options=JobOptions(key_file=sys.argv[3]))
print(torch.get_num_threads())
"""


def _params(url: str) -> dict[str, torch.Tensor]:
    latest = Store.open(url, create=False).latest()
    assert latest is not None and latest.step == CFG.dp.steps
    return model_state(latest)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def threads_matter() -> bool:
    """Whether 1 and 2 torch threads give other bits for the MLP's clipped sums at the
    batch sizes the job draws on this machine. They do on some CPUs (the GEMMs block by
    thread count) and not on others (seen: an Intel Xeon where 1-4 threads agree at every
    size): the record's premise is the machine's, so the tests assert what it does."""
    tr = build_trainer(CFG, KEY)
    try:
        for m in range(5, 12):
            batch = tr.data.gather(torch.arange(m))
            sums = []
            for n in (1, 2):
                with fixed_threads(n):
                    sums.append(tr.grads.clipped_sum(batch, CFG.dp.max_grad_norm).summed)
            if not torch.equal(*sums):
                return True
        return False
    finally:
        tr.close()


def _gold(tmp_path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    key = str(tmp_path / "k")
    with fixed_threads(2):
        run_job(CFG2, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    return key, _params(str(tmp_path / "gold.zarr"))


def test_the_pinned_count_gives_its_bits_on_a_process_at_another_count() -> None:
    """The trainer's pinned path gives its count's bits on a process at another count,
    and restores the process's count after the gradients."""
    tr = build_trainer(CFG, KEY)
    batch = tr.data.gather(torch.arange(7))
    sums = {}
    for n in (1, 2):
        with fixed_threads(n):
            sums[n] = tr.grads.clipped_sum(batch, CFG.dp.max_grad_norm).summed
    # the premise (other bits per thread count) is the machine's: `threads_matter`
    for pinned, other in ((1, 2), (2, 1)):
        tr.grad_threads = pinned
        with fixed_threads(other):
            got, _ = tr.clipped_sum(torch.arange(7))
            assert torch.get_num_threads() == other  # restored after the gradients
        assert torch.equal(got, sums[pinned])
    tr.close()


def _old_default(m: pytest.MonkeyPatch) -> None:
    """New jobs default to torch's count, as before `default_grad_threads`."""
    m.setattr(grad_threads_mod, "ONE_THREAD_BELOW", 0)


def test_an_old_store_keeps_its_count_on_one_thread_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose job took torch's 2 threads by the old default resumes at 2 in a
    process on one thread whose new jobs of this size default to 1, bit-identical."""
    key, gold = _gold(tmp_path)
    url = str(tmp_path / "run.zarr")
    with monkeypatch.context() as m, fixed_threads(2):
        _old_default(m)
        run_job(CFG, url, stop_after=7, options=JobOptions(key_file=key))  # newest version: step 5
    assert records_of(Store.open(url, create=False).latest())["grad_threads"] == 2  # type: ignore[arg-type]
    assert build_trainer(CFG, KEY).grad_threads == 1  # what a new job takes now
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RESUME, json.dumps(CFG.to_record()), url, key],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split()[-1] == "1"  # the process's own count is left as it was
    assert _same(_params(url), gold)
    assert records_of(Store.open(url, create=False).latest())["grad_threads"] == 2  # type: ignore[arg-type]


@pytest.mark.parametrize("now", [1, 2])
def test_a_store_without_the_record_resumes_at_the_current_count_and_records_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    threads_matter: bool,
    now: int,
) -> None:
    """A store written before the record (at torch's count, the default then) resumes at
    this process's count, as before the record existed, not at the new default's (1 for
    this model): on 2 threads bit-identical to the 2-thread run, on one thread its
    parameters leave it, which is what the record prevents. Later versions record it."""
    key, gold = _gold(tmp_path)
    url = str(tmp_path / "old.zarr")

    def without_record(*args: Any) -> Any:
        rec = dict(job_records(*args))
        del rec["grad_threads"]
        return rec

    with monkeypatch.context() as m, fixed_threads(2):
        _old_default(m)
        m.setattr(session, "job_records", without_record)
        m.setattr(job_records_mod, "REQUIRED", tuple(set(REQUIRED) - {"grad_threads"}))
        run_job(CFG, url, stop_after=7, options=JobOptions(key_file=key))
    assert "grad_threads" not in records_of(Store.open(url, create=False).latest())  # type: ignore[arg-type]
    caplog.set_level(logging.INFO, "cocoon_ckpt.train.grad_threads")
    with fixed_threads(now):
        run_job(CFG, url, options=JobOptions(key_file=key))
    assert not caplog.records  # nothing restored, nothing to say
    # other bits exactly where this machine's thread count changes them
    assert _same(_params(url), gold) is (now == 2 or not threads_matter)
    store = Store.open(url, create=False)
    assert records_of(store.latest())["grad_threads"] == now  # type: ignore[arg-type]


def test_resume_logs_the_restored_count_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key, gold = _gold(tmp_path)
    url = str(tmp_path / "run.zarr")
    with fixed_threads(1):
        run_job(CFG2, url, stop_after=7, options=JobOptions(key_file=key))
    caplog.set_level(logging.INFO, "cocoon_ckpt.train.grad_threads")
    with fixed_threads(1):
        run_job(CFG, url, options=JobOptions(key_file=key))
        assert torch.get_num_threads() == 1
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "recorded 2 torch threads" in said[0]
    assert _same(_params(url), gold)


def test_another_explicit_count_on_resume_is_refused_and_nothing_written(
    tmp_path: Path,
) -> None:
    key = str(tmp_path / "k")
    url = str(tmp_path / "run.zarr")
    with fixed_threads(2):  # the default for this size: one thread, recorded
        run_job(CFG, url, stop_after=7, options=JobOptions(key_file=key))
    before = Store.open(url, create=False).versions()
    with pytest.raises(ConfigMismatchError, match=r"grad_threads=1.*grad_threads=2") as err:
        run_job(CFG2, url, options=JobOptions(key_file=key))
    assert err.value.differences == ["grad_threads: stored 1, now 2"]
    assert Store.open(url, create=False).versions() == before
    # the stored count asked for explicitly (JobConfig.grad_threads, --grad-threads) is
    # accepted, and it is not part of the fingerprint
    run_job(dataclasses.replace(CFG, grad_threads=1), url, options=JobOptions(key_file=key))
    assert Store.open(url, create=False).latest().step == CFG.dp.steps  # type: ignore[union-attr]


def _linear_trainer(fan_in: int, grad_threads: int | None = None) -> DPTrainer:
    model = torch.nn.Linear(fan_in, 512)  # (fan_in + 1) x 512 dense parameters
    data = [torch.zeros(512, fan_in), torch.zeros(512, 512)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.mse_loss
    return DPTrainer(model, opt, loss, data, CFG.dp, KEY, grad_threads=grad_threads)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_new_job_takes_one_thread_below_the_size_and_torchs_count_from_it(
    threads: int,
) -> None:
    """The default by dense size m: 1 below `ONE_THREAD_BELOW` (2^18), torch's count from
    there; an explicit count is taken whatever the size."""
    assert grad_threads_mod.ONE_THREAD_BELOW == 1 << 18 == 512 * 512
    with fixed_threads(threads):
        below, at = _linear_trainer(510), _linear_trainer(511)
        assert (below.dim, at.dim) == (511 * 512, 512 * 512)
        assert (below.grad_threads, at.grad_threads) == (1, threads)
        assert _linear_trainer(510, grad_threads=threads).grad_threads == threads
        assert _linear_trainer(511, grad_threads=1).grad_threads == 1
        assert build_trainer(CFG, KEY).grad_threads == 1  # the mlp example, m 6,404
        assert torch.get_num_threads() == threads  # the process's count is left alone
    for tr in (below, at):
        tr.close()


def test_embedding_tables_are_not_counted() -> None:
    """m counts the parameters the per-sample gradients form: a DLRM whose table (40,000
    x 8) gets per-row gradients and embedding noise takes one thread, the same model with
    its table in the dense noise vector torch's count."""
    cfg = job_config("dlrm", bands=2, steps=4)
    cfg = dataclasses.replace(cfg, options={"tables": [40_000], "dim": 8})
    with fixed_threads(2):
        dense = build_trainer(cfg, KEY)
        tables = build_trainer(dataclasses.replace(cfg, embedding=EmbeddingConfig()), KEY)
    assert dense.dim >= grad_threads_mod.ONE_THREAD_BELOW > tables.dim
    assert (dense.grad_threads, tables.grad_threads) == (2, 1)
    for tr in (dense, tables):
        tr.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_a_bad_count_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="grad_threads="):
        build_trainer_with(bad)


def build_trainer_with(grad_threads: Any) -> None:
    model = torch.nn.Linear(2, 1)
    data = [torch.zeros(512, 2), torch.zeros(512, 1)]
    DPTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss,
        data,
        CFG.dp,
        KEY,
        grad_threads=grad_threads,
    )


def test_the_cli_records_its_count_and_refuses_a_bad_one(tmp_path: Path) -> None:
    store, key = tmp_path / "cli.zarr", tmp_path / "k"
    base = [
        sys.executable,
        "-m",
        "cocoon_ckpt",
        "train",
        "--example",
        "mlp",
        "--steps",
        "4",
        "--bands",
        "2",
    ]
    base += ["--checkpoint-every", "4", "--no-progress", "--key-file", str(key)]
    bad = subprocess.run(
        [*base, "--store", str(store), "--grad-threads", "0"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--grad-threads 0" in bad.stderr and bad.stderr.count("\n") == 1
    assert not store.exists() and not key.exists()
    ok = subprocess.run(
        [*base, "--store", str(store), "--grad-threads", "1"], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and records_of(latest)["grad_threads"] == 1
    shown = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "inspect", str(store)], capture_output=True, text=True
    )
    assert "gradients on 1 torch thread (kept on resume)" in shown.stdout


class _Rank1:
    """Rank 1 of 2 in one process, whose coordinator runs its gradients on 3 threads."""

    rank, world, is_coordinator = 1, 2, False

    def agree(self, failure: BaseException | None) -> None:
        assert failure is None

    def broadcast_object(self, obj: Any) -> Any:
        return 3  # the coordinator's count, whatever this rank has


@pytest.mark.parametrize(("resume", "expected"), [(None, 3), (("store", "version"), 1)])
def test_a_new_multi_rank_job_takes_the_coordinators_count(
    monkeypatch: pytest.MonkeyPatch, resume: Any, expected: int
) -> None:
    """The record holds rank 0's count and a resume sets every rank to it, so a new job's
    ranks must all run at rank 0's from the first step (a resume already reads it)."""
    mine = types.SimpleNamespace(grad_threads=1, close=lambda: None)  # this rank's default
    monkeypatch.setattr(start, "prepare_trainer", lambda *a: mine)
    got: Any = start.trainer_on_ranks(CFG, KEY, None, _Rank1(), resume, ResumeAllowances())  # type: ignore[arg-type]
    assert got is mine and got.grad_threads == expected
