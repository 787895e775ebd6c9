"""A damaged old manifest stops retention after a commit, but not the training."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from cocoon_ckpt import run_job
from state import Store

from .conftest import job_config


def test_training_goes_on_and_keeps_a_damaged_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = str(tmp_path / "s.zarr")
    config = replace(job_config("mlp", bands=2, steps=6, keep_last=2), checkpoint_every=2)
    run_job(config, url, stop_after=4)
    store = Store.open(url, create=False)
    first = store.versions()[0]
    path = tmp_path / "s.zarr" / "manifests" / f"{first:08d}.json"
    raw = path.read_bytes()
    damaged = raw.replace(b'"step": ', b'"step": 1', 1)  # still valid JSON
    path.write_bytes(damaged)
    folders = sorted(p.name for p in (tmp_path / "s.zarr" / "versions").iterdir())
    with caplog.at_level(logging.WARNING, logger="cocoon_ckpt.train.checkpoint"):
        run_job(config, url)  # resumes from the newest, commits, retention stops
    assert any("retention skipped" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == damaged  # neither the manifest ...
    after = sorted(p.name for p in (tmp_path / "s.zarr" / "versions").iterdir())
    assert set(folders) <= set(after)  # ... nor any folder was deleted
    latest = store.latest()
    assert latest is not None and latest.step == 6
