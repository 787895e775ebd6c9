"""Numbers and data a job refuses before they can hurt it: a sigma, learning rate or lease
expiry outside its range, a scheduler or state the store cannot keep (all before the first
write), a non-finite per-sample gradient (at its step, naming the example), a model with
non-finite parameters at export; and a key file that a failed write does not leave half
made."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.keys import KEY_BYTES, create_key_file
from cocoon_ckpt.train.config import MAX_LR, MIN_LEASE_EXPIRY_S, DPConfig, JobConfig
from cocoon_ckpt.train.options import JobOptions
from state import Store

SMALL = (
    *("--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress"),
    *("--dataset-size", "256", "--batch-size", "16"),
)


def _tree_hash(root: Path) -> str:
    """One hash of every path and file's bytes under `root` ('' where nothing is)."""
    if not root.exists():
        return ""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("cocoon-ckpt")]
    assert len(lines) == 1 and lines[0].startswith("cocoon-ckpt: error: "), err
    return lines[0]


#: A user's job module: the example MLP over its own map-style Dataset, with NaN or inf
#: planted in the inputs of the examples `options["nan"]` / `options["inf"]` name, or a
#: ReduceLROnPlateau scheduler, or a NaN buffer the forward pass never reads, or a loss
#: that is -inf while its gradients are finite.
JOB = """
import torch
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts


class Pairs(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return int(self.x.shape[0])

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _parts(config, **kw):
    p = mlp.build(config)
    x, y = p.data
    x = x.clone()
    for i in config.options.get("nan", []):
        x[i, 0] = float("nan")
    for i in config.options.get("inf", []):
        x[i, 1] = float("inf")
    kw.setdefault("model", p.model)
    return JobParts(optimizer=p.optimizer, loss_fn=p.loss_fn, dataset=Pairs(x, y), **kw)


def data(config):
    return _parts(config)


def plateau(config):
    p = mlp.build(config)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(p.optimizer)
    return JobParts(
        model=p.model, optimizer=p.optimizer, loss_fn=p.loss_fn, dataset=Pairs(*p.data),
        scheduler=sched,
    )


class Deep:
    # a stateful part whose state nests 200 lists deep

    def state_dict(self):
        state = []
        for _ in range(200):
            state = [state]
        return {"deep": state}

    def load_state_dict(self, state):
        pass


def deep_state(config):
    p = mlp.build(config)
    return JobParts(
        model=p.model, optimizer=p.optimizer, loss_fn=p.loss_fn, dataset=Pairs(*p.data),
        stateful={"deep": Deep()},
    )


class WithBuffer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("calibration", torch.full((3,), float("nan")))

    def forward(self, x):
        return self.inner(x)


def nan_buffer(config):
    p = mlp.build(config)
    model = WithBuffer(p.model)
    return JobParts(model=model, optimizer=p.optimizer, loss_fn=p.loss_fn, dataset=Pairs(*p.data))


def minus_inf_loss(config):
    p = mlp.build(config)

    def loss(out, y):  # -inf, with the cross entropy's finite gradient
        return nn.functional.cross_entropy(out, y) + torch.log(torch.zeros(()))

    return JobParts(model=p.model, optimizer=p.optimizer, loss_fn=loss, dataset=Pairs(*p.data))
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a fresh module holding JOB in tmp_path, the current directory (found
    there as the console script finds a user's job)."""
    name = f"numbersjob_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(JOB)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def _refused_before_writing(
    tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture[str], code: int
) -> str:
    """Run `argv`; assert exit `code`, one error line, and tmp_path unchanged (no store,
    no key). Returns the line."""
    before = _tree_hash(tmp_path)
    assert main(argv) == code
    line = _one_error_line(capsys)
    assert _tree_hash(tmp_path) == before
    return line


# numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sigma", ["1e-300", "0.29", "1e308", "1.0000001e8"])
def test_a_noise_multiplier_out_of_range_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sigma: str
) -> None:
    argv = ["train", "--store", str(tmp_path / "s.zarr"), *SMALL, "--noise-multiplier", sigma]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)
    assert f"--noise-multiplier {float(sigma)!r} must" in line
    assert "lie in [0.3, 1e+08]" in line


def test_the_ends_of_the_sigma_range_are_accepted() -> None:
    for sigma in (0.3, 1e8):
        DPConfig(steps=4, batch_size=4, dataset_size=64, noise_multiplier=sigma)


def test_a_target_epsilon_that_needs_sigma_above_the_range_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the longest job a config allows, every example in every step: at sigma = 1e8 its
    # RDP epsilon is still above 1e-3
    argv = ["train", "--store", str(tmp_path / "s.zarr"), "--no-progress"]
    argv += ["--steps", str(2**31 - 1), "--bands", "1", "--dataset-size", "256"]
    argv += ["--batch-size", "256", "--target-epsilon", "0.001", "--accountant", "rdp"]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)  # a target no sigma meets: malformed
    assert "target_epsilon=0.001" in line and "above 1e+08" in line


def test_a_learning_rate_above_the_range_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--store", str(tmp_path / "s.zarr"), *SMALL, "--lr", "1e308"]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)
    assert "--lr 1e+308 must" in line and f"at most {MAX_LR:g}" in line
    JobConfig(job="example:mlp", dp=DPConfig(steps=4, batch_size=4, dataset_size=64,
              noise_multiplier=1.0), lr=MAX_LR)  # fmt: skip


@pytest.mark.parametrize("expiry", ["1e-9", "4.99"])
def test_a_lease_expiry_below_the_minimum_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], expiry: str
) -> None:
    argv = ["train", "--store", str(tmp_path / "s.zarr"), *SMALL, "--lease-expiry", expiry]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)
    assert f"--lease-expiry {float(expiry)!r} must" in line
    assert f"at least {MIN_LEASE_EXPIRY_S:g} seconds" in line


def test_a_scheduler_that_steps_on_a_metric_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    argv = ["train", "--job", f"{job}:plateau", "--store", str(tmp_path / "s.zarr"), *SMALL]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)
    assert "scheduler ReduceLROnPlateau steps on metrics" in line
    assert "use a schedule fixed in advance" in line


# key file ------------------------------------------------------------------------------


def _failing_write_to(path: Path, real: Callable[[int, bytes], int]) -> Callable[..., int]:
    """os.write that fails with ENOSPC on the file at `path` (a full disk), and writes
    every other file as it would."""
    target = os.path.realpath(path)

    def write(fd: int, data: bytes) -> int:
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            name = ""
        if name == target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    return write


def test_a_key_file_on_a_full_disk_is_removed_and_the_rerun_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store, key = tmp_path / "s.zarr", tmp_path / "noise.key"
    argv = ["train", "--store", str(store), "--key-file", str(key), *SMALL]
    monkeypatch.setattr(os, "write", _failing_write_to(key, os.write))
    assert main(argv) == 3  # the run failed (the disk), not refused
    assert "No space left on device" in _one_error_line(capsys)
    assert not key.exists()  # no 0-byte key to refuse the rerun
    monkeypatch.undo()
    assert main(argv) == 0
    assert key.stat().st_size == KEY_BYTES
    assert sorted(p.name for p in (store / "manifests").iterdir()) == [
        "00000001.json",
        "00000002.json",
    ]


def test_a_key_file_past_the_file_size_limit_is_removed(tmp_path: Path) -> None:
    # a real short write, then EFBIG: the file size limit stands in for a full disk
    key = tmp_path / "noise.key"
    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        from cocoon_ckpt.keys import create_key_file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))
        try:
            create_key_file({str(key)!r}, bytes(range(32)))
        except OSError as exc:
            print(exc.errno)
            sys.exit(3)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert int(done.stdout) == errno.EFBIG
    assert not key.exists()


def test_create_key_file_writes_the_whole_key_0600_and_never_overwrites(tmp_path: Path) -> None:
    key = tmp_path / "noise.key"
    create_key_file(str(key), bytes(range(32)))
    assert key.read_bytes() == bytes(range(32))
    assert key.stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        create_key_file(str(key), bytes(32))
    assert key.read_bytes() == bytes(range(32))  # the existing key stays


def test_a_stateful_part_nested_too_deep_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    argv = ["train", "--job", f"{job}:deep_state", "--store", str(tmp_path / "s.zarr"), *SMALL]
    line = _refused_before_writing(tmp_path, argv, capsys, 2)
    assert "stateful/deep" in line and "nests deeper than" in line


# data ------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [None, 3, 4])
def test_the_clipped_sum_names_each_non_finite_example_in_batch_order(chunk: int | None) -> None:
    import torch
    from torch import nn

    from cocoon_ckpt.train.grads import PerSampleGrads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    names = [k for k, _ in model.named_parameters()]
    ps = PerSampleGrads(model, nn.functional.cross_entropy, names)
    x, y = torch.randn(10, 5), torch.randint(0, 3, (10,))
    # twice each: the second pass replays the recorded tape where one was recorded
    for _ in range(2):
        assert ps.clipped_sum([x, y], 1.0, chunk).nonfinite == []
    bad = x.clone()
    bad[3, 0], bad[8, 2] = float("nan"), float("inf")
    for _ in range(2):
        got = ps.clipped_sum([bad, y], 1.0, chunk)
        assert got.nonfinite == [3, 8]
        assert not bool(got.summed.isfinite().all())  # what the trainer must not apply


def _first_step_with(index_choice: Callable[[list[set[int]]], tuple[int, int]]) -> tuple[int, int]:
    """(step, example) chosen from the batches SMALL's job draws (N=256, B=16, b=2,
    seed 0), read from the real sampler."""
    sampler = CyclicPoissonSampler(dataset_size=256, batch_size=16, bands=2, seed=0)
    return index_choice([set(sampler.batch(t).tolist()) for t in range(4)])


def _new_at_step_2(batches: list[set[int]]) -> tuple[int, int]:
    """An example step 2 draws that steps 0 and 1 did not."""
    fresh = sorted(batches[2] - batches[0] - batches[1])
    return 2, fresh[0]


def _committed(store: Path) -> str:
    """A hash of what the store has committed (manifests and version arrays; the lease
    a rerun takes and releases is not a commit)."""
    return _tree_hash(store / "manifests") + _tree_hash(store / "versions")


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap_noise"])
def test_a_non_finite_example_is_refused_at_its_step_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str, overlap: bool
) -> None:
    step, bad = _first_step_with(_new_at_step_2)
    store, key = tmp_path / "s.zarr", tmp_path / "noise.key"
    argv = ["train", "--job", f"{job}:data", "--store", str(store), "--key-file", str(key)]
    argv += [*SMALL, "--job-option", f"nan=[{bad}]"] + (["--overlap-noise"] if overlap else [])
    assert main(argv) == 3  # a failed run: its data, not the store
    line = _one_error_line(capsys)
    assert line.startswith(f"cocoon-ckpt: error: step {step}: the per-sample gradient of ")
    assert f"dataset example {bad} is not finite" in line
    # the version of step 2 (written before step 2 ran) is the newest, its model finite
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == step
    assert sorted(p.name for p in (store / "manifests").iterdir()) == ["00000001.json"]
    assert all(bool(v.isfinite().all()) for v in model_state(latest).values())
    # a rerun meets the same example and commits nothing
    committed = _committed(store)
    assert main(argv) == 3
    assert f"dataset example {bad} is not finite" in _one_error_line(capsys)
    assert _committed(store) == committed


def test_every_non_finite_example_of_the_step_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    sampler = CyclicPoissonSampler(dataset_size=256, batch_size=16, bands=2, seed=0)
    first = sampler.batch(0).tolist()
    nan, inf = first[0], first[-1]
    store = tmp_path / "s.zarr"
    argv = ["train", "--job", f"{job}:data", "--store", str(store), *SMALL]
    argv += ["--job-option", f"nan=[{nan}]", "--job-option", f"inf=[{inf}]"]
    assert main(argv) == 3
    line = _one_error_line(capsys)
    assert f"step 0: the per-sample gradient of dataset examples {nan}, {inf} is" in line
    assert not (store / "manifests").exists() or not any((store / "manifests").iterdir())


def test_export_refuses_a_model_with_non_finite_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    store = tmp_path / "s.zarr"
    argv = ["train", "--job", f"{job}:nan_buffer", "--store", str(store), *SMALL]
    assert main(argv) == 0
    capsys.readouterr()
    out = tmp_path / "model.pt"
    before = _tree_hash(tmp_path)
    assert main(["export", str(store), "--out", str(out)]) == 1
    line = _one_error_line(capsys)
    assert "holds non-finite values (NaN or inf) in calibration" in line
    assert _tree_hash(tmp_path) == before  # neither the model nor its report


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> object:
        raise ValueError(f"{constant} in a manifest")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_loss_with_finite_gradients_trains_and_stays_out_of_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], job: str
) -> None:
    store = tmp_path / "s.zarr"
    argv = ["train", "--job", f"{job}:minus_inf_loss", "--store", str(store), *SMALL]
    assert main(argv) == 0
    capsys.readouterr()
    for manifest in (store / "manifests").iterdir():
        _strict_json(manifest.read_text())  # valid JSON: no NaN, Infinity or -Infinity
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None
    series = latest.records["metrics"]["series"]
    assert "loss" not in series  # no point: its every value was -inf
    assert "grad_norm" in series
    assert all(bool(v.isfinite().all()) for v in model_state(latest).values())


@pytest.mark.slow
def test_a_non_finite_example_on_one_rank_is_refused_on_every_rank(
    tmp_path: Path, job: str
) -> None:
    # two real ranks (gloo); the example is in rank 1's share of step 2's batch only
    from tests.cocoon_ckpt.test_distributed_refusals import _ranks

    sampler = CyclicPoissonSampler(dataset_size=256, batch_size=16, bands=2, seed=0)
    batches = [sampler.batch(t) for t in range(4)]
    share = np.array_split(batches[2], 2)[1].tolist()  # DistContext.my_examples of rank 1
    bad = next(i for i in share if i not in batches[0] and i not in batches[1])
    store = tmp_path / "s.zarr"
    argv = ["train", "--job", f"{job}:data", "--store", str(store), "--key-file"]
    argv += [str(tmp_path / "k"), *SMALL, "--job-option", f"nan=[{bad}]"]
    ranks = _ranks(2, argv)
    assert [code for code, _ in ranks] == [3, 3], ranks
    line = ranks[0][1]
    assert line.startswith("cocoon-ckpt: error: step 2: the per-sample gradient of ")
    assert f"dataset example {bad} is not finite" in line
    assert ranks[1][1] == line  # one message on every rank: rank 1's
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 2


def test_a_loop_that_catches_the_refusal_commits_nothing_of_the_step(
    tmp_path: Path,
) -> None:
    # the user's own loop: the refusal caught, the job closed as if nothing happened
    import dataclasses

    from cocoon_ckpt.errors import NonFiniteGradientError
    from cocoon_ckpt.examples import mlp
    from cocoon_ckpt.train.session import open_job
    from tests.cocoon_ckpt.conftest import job_config

    config = dataclasses.replace(job_config(bands=2, steps=8), checkpoint_every=2)
    parts = mlp.build(config)
    x, y = parts.data
    sampler = CyclicPoissonSampler(dataset_size=512, batch_size=16, bands=2, seed=0)
    seen = set(sampler.batch(0).tolist()) | set(sampler.batch(1).tolist())
    bad = next(i for i in sampler.batch(2).tolist() if i not in seen)
    x = x.clone()
    x[bad, 0] = float("nan")
    parts = dataclasses.replace(parts, data=None, dataset=(x, y))
    store = tmp_path / "s.zarr"
    job = open_job(config, str(store), parts, options=JobOptions(key_file=str(tmp_path / "k")))
    with pytest.raises(NonFiniteGradientError) as refused:
        for _ in job.steps():
            pass
    assert (refused.value.step, refused.value.indices) == (2, [bad])
    job.wait()  # the version of step 2 is written in the background: let it land first
    committed = _committed(store)
    with pytest.raises(RuntimeError, match="^step 2 stopped halfway"):
        job.trainer.state_dict()  # what a Checkpointer would snapshot
    job.close()  # the step reached is the newest version's: nothing to write
    assert _committed(store) == committed
    newest = Store.open(str(store), create=False).latest()
    assert newest is not None and newest.step == 2  # the steps before the refused one
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 2
