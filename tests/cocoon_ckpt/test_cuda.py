"""A job on a CUDA device: it runs there, its noise is bit for bit the CPU run's (I1
across device types: the keyed generator draws on the host), and a resume on CUDA ends
as the uninterrupted CUDA run. Skipped where CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cocoon_ckpt import JobConfig, run_job
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.format.stored import model_state
from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import Store

from .conftest import job_config

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())"
)

KEY = bytes(range(32))


def on_cuda(config: JobConfig) -> JobParts:
    """The mlp example with its model on the GPU (the data stays on the host)."""
    parts = mlp.build(config)
    parts.model.to("cuda")
    return parts


def test_a_job_runs_on_cuda_with_the_cpu_runs_noise() -> None:
    cfg = job_config("mlp", bands=4, steps=6)
    gpu, cpu = build_trainer(cfg, KEY, on_cuda), build_trainer(cfg, KEY)
    assert gpu.device.type == "cuda" and gpu.identity["device"] == {"type": "cuda"}  # type: ignore[typeddict-item]
    for _ in range(cfg.dp.steps):
        gpu.train_step()
        cpu.train_step()
        assert gpu.last_noise is not None and cpu.last_noise is not None
        assert torch.equal(gpu.last_noise.cpu(), cpu.last_noise)  # I1 across device types
    assert all(p.device.type == "cuda" for p in gpu.model.parameters())
    for a, b in zip(gpu.model.parameters(), cpu.model.parameters(), strict=True):
        torch.testing.assert_close(a.detach().cpu(), b.detach(), rtol=1e-4, atol=1e-5)
    gpu.close()
    cpu.close()


def test_a_resume_on_cuda_is_exact(tmp_path: Path) -> None:
    cfg = job_config("mlp", bands=4, steps=12)
    gold, run, key = str(tmp_path / "g.zarr"), str(tmp_path / "r.zarr"), str(tmp_path / "k")
    run_job(cfg, gold, parts=on_cuda, options=JobOptions(key_file=key))
    assert (
        run_job(cfg, run, parts=on_cuda, stop_after=7, options=JobOptions(key_file=key)).steps_done
        == 7
    )
    assert run_job(cfg, run, parts=on_cuda, options=JobOptions(key_file=key)).resumed_from == 7
    a, b = (Store.open(u, create=False).latest() for u in (gold, run))
    assert a is not None and b is not None
    ma, mb = model_state(a), model_state(b)
    assert all(torch.equal(ma[k], mb[k]) for k in ma)
