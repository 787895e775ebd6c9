"""examples/digits/run.py's model and data import: the job builder the CLI's `--job`
takes resolves from the repository root and builds the parts the script trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cocoon_ckpt.train.build import build_trainer
from cocoon_ckpt.train.parts import JobParts, resolve

ROOT = Path(__file__).resolve().parents[2]


def test_the_digits_job_builder_resolves_and_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    builder = resolve("examples.digits.run:build", search_cwd=True)
    example = __import__("examples.digits.run", fromlist=["make_config"])
    config = example.make_config(1)
    parts = builder(config)
    assert isinstance(parts, JobParts) and len(parts.dataset) == config.dp.dataset_size  # type: ignore[arg-type]
    model = example.make_model()
    assert all(
        torch.equal(a, b)
        for a, b in zip(parts.model.state_dict().values(), model.state_dict().values(), strict=True)
    )
    trainer = build_trainer(config, bytes(32), builder)
    try:
        assert trainer.step_index == 0 and trainer.config.steps == example.PER_EPOCH
    finally:
        trainer.close()
