"""The config is the record (#28): `train --job` of a user's job that builds its own
optimizer and Dataset runs with none of --optimizer, --lr and --dataset-size; the
store records what the objects are, a resume is bit-identical, and a flag given
against the objects is an override that is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from state import Store

JOB = """
import torch
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt import JobParts


class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def build(config):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return JobParts(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
        loss_fn=nn.functional.cross_entropy,
        dataset=Points(1024),
    )
"""
FLAGS = ("--steps", "8", "--bands", "2", "--batch-size", "16", "--checkpoint-every", "4")


def _train(cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "cocoon_ckpt",
            "train",
            "--job",
            "userjob:build",
            *FLAGS,
            "--key-file",
            "k",
            "--quiet",
            "--json",
            *extra,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "userjob.py").write_text(JOB)
    (tmp_path / "k").write_bytes(os.urandom(32))
    (tmp_path / "k").chmod(0o600)
    return tmp_path


def _model(store: Path) -> dict[str, str]:
    newest = Store.open(str(store), create=False).latest()
    assert newest is not None
    return {k: m.checksum for k, m in newest.manifest.arrays.items() if k.startswith("model/")}


def test_a_users_job_needs_none_of_the_example_flags(work: Path) -> None:
    whole = _train(work, "--store", "whole.zarr")
    assert whole.returncode == 0, whole.stderr
    config = Store.open(str(work / "whole.zarr"), create=False).latest()
    assert config is not None
    rec = config.records["config"]
    assert (rec["optimizer"], rec["lr"], rec["dp"]["dataset_size"]) == ("sgd", 0.2, 1024)
    # stopped after its first version and resumed, with the same command: the same bits
    half = _train(work, "--store", "half.zarr")
    assert half.returncode == 0, half.stderr
    (work / "half.zarr" / "manifests" / "00000002.json").unlink()
    again = _train(work, "--store", "half.zarr")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["steps"] == 8
    assert _model(work / "half.zarr") == _model(work / "whole.zarr")


def test_a_flag_given_against_the_objects_is_refused_writing_nothing(work: Path) -> None:
    for flag, value, said in (
        ("--lr", "0.3", "lr=0.3"),
        ("--optimizer", "adam", "optimizer='adam'"),
        ("--dataset-size", "512", "512"),
    ):
        run = _train(work, "--store", "s.zarr", flag, value)
        assert run.returncode == 2, (flag, run.stderr)
        assert said in run.stderr, (flag, run.stderr)
        assert not (work / "s.zarr").exists()
