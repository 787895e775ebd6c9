"""The CUDA generators' states travel with every version (dropout on a GPU draws from
them), shown on the CPU with torch.cuda's state functions stood in for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cocoon_ckpt import run_job
from cocoon_ckpt.format.packed import unpack_array
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .conftest import job_config


def test_cuda_generator_states_are_stored_and_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in states])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda got: restored.append(list(got)))
    cfg = job_config("mlp", bands=2, steps=8)
    url, key = str(tmp_path / "run.zarr"), str(tmp_path / "k")
    run_job(cfg, url, stop_after=5, options=JobOptions(key_file=key))  # checkpoint_every=5
    latest = Store.open(url, create=False).latest()
    assert latest is not None and latest.records["rng"]["cuda"] == 2
    packed = latest.records["rng"]["packed"]  # in the record, not arrays of their own
    assert not any(n.startswith("rng/") for n in latest.array_names())
    for i, s in enumerate(states):
        assert torch.equal(torch.from_numpy(unpack_array(packed[f"cuda/{i}"])), s)
    assert restored == []
    run_job(
        cfg, url, options=JobOptions(key_file=key)
    )  # the resume sets them back before its first step
    assert len(restored) == 1
    assert all(torch.equal(a, b) for a, b in zip(restored[0], states, strict=True))


def test_a_store_without_cuda_states_restores_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    called: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", called.append)
    cfg = job_config("mlp", bands=2, steps=7)
    url, key = str(tmp_path / "run.zarr"), str(tmp_path / "k")
    run_job(cfg, url, stop_after=5, options=JobOptions(key_file=key))
    latest = Store.open(url, create=False).latest()
    assert latest is not None and "cuda" not in latest.records["rng"]
    run_job(cfg, url, options=JobOptions(key_file=key))
    assert called == []
