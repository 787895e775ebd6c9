"""The device type is part of a job's identity: a store written on the CPU refuses a
resume on another device type, listing the difference and writing nothing. Simulated
without a GPU: the resumed job's identity claims "cuda"."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt import run_job
from cocoon_ckpt.errors import ConfigMismatchError
from cocoon_ckpt.train import identity, trainer
from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.device import model_device
from cocoon_ckpt.train.options import JobOptions

from .conftest import job_config

KEY = bytes(range(32))


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
        for p in sorted(root.rglob("*"))
    }


def test_a_cpu_store_refuses_a_resume_on_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = job_config("mlp", bands=2, steps=8)
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    assert run_job(cfg, url, stop_after=5, options=JobOptions(key_file=key)).steps_done == 5
    before = _tree(Path(url))

    def on_cuda(*args: Any, **kwargs: Any) -> Any:
        optimizer, scheduler, dataset, size, seed = args[:5]
        return identity.job_identity(
            optimizer, scheduler, dataset, size, seed, torch.device("cuda")
        )

    monkeypatch.setattr(trainer, "job_identity", on_cuda)
    with pytest.raises(ConfigMismatchError, match=r"device.type: stored 'cpu', now 'cuda'") as info:
        run_job(cfg, url, options=JobOptions(key_file=key))
    assert info.value.differences == ["device.type: stored 'cpu', now 'cuda'"]
    assert _tree(Path(url)) == before  # refused before the first write


def test_device_type_recorded_off_the_cpu_and_allowed_on_request() -> None:
    tr = build_trainer(job_config("mlp", bands=2, steps=8), KEY)
    assert tr.device == torch.device("cpu") == model_device(tr.model, tr.param_names)
    assert "device" not in tr.identity  # the CPU: as stores written before the field
    args = (tr.optimizer, None, tr.dataset, tr.data.size, 0)
    cuda = identity.job_identity(*args, torch.device("cuda", 1))
    assert cuda["device"] == {"type": "cuda"}
    assert identity.identity_differences(tr.identity, cuda) == [
        "device.type: stored 'cpu', now 'cuda'"
    ]
    assert identity.identity_differences(tr.identity, cuda, allow_device_change=True) == []
    assert identity.identity_differences(cuda, cuda) == []
    tr.close()
