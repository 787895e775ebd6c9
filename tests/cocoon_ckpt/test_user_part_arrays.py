"""A job's own parts (its scheduler and `stateful` parts) may hold tensors: the arrays
their records name are the version's, so the bounds check and the audit accept them,
and refuse an array a part's record names outside that part's folder."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from cocoon_ckpt import run_job
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.format.parts import user
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.bounds import check_bounds
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import Store

from .conftest import job_config


class _Average:
    """A running average of the model's weights: a stateful part holding tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.avg = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"avg": self.avg, "n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.avg = {k: v.clone() for k, v in state["avg"].items()}


class _Warm(torch.optim.lr_scheduler.StepLR):
    """A StepLR whose state holds a tensor too."""

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "warm": torch.ones(3)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "warm"})


def _build(config: JobConfig) -> JobParts:
    base = mlp.build(config)
    return dataclasses.replace(
        base,
        scheduler=_Warm(base.optimizer, step_size=2),
        stateful={"average": _Average(base.model)},
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("user_parts")
    url, key = str(root / "s.zarr"), str(root / "k")
    run_job(
        job_config("mlp", bands=2, steps=4), url, parts=_build, options=JobOptions(key_file=key)
    )
    return url, key


def test_the_arrays_of_a_jobs_own_parts_are_within_bounds(store: tuple[str, str]) -> None:
    s = Store.open(store[0], create=False)
    for v in s.versions():
        m = s.manifest(v)
        kinds = {n.split("/")[0] for n in m.arrays}
        assert {"scheduler", "stateful"} <= kinds
        bounds = check_bounds(m)
        assert bounds.problems == [], bounds.problems
        assert not bounds.unsafe


def test_the_audit_of_a_job_with_its_own_parts_finds_nothing(store: tuple[str, str]) -> None:
    report = audit_store(store[0], key_file=store[1], job=_build)
    assert [f for f in report.findings if "bounds" in str(f)] == []


def test_a_part_record_naming_an_array_outside_its_folder_is_refused() -> None:
    rec: Any = {"kind": "job.Part", "state": {"dict": [["w", {"tensor": "model/0.weight"}]]}}
    with pytest.raises(ValueError, match="job.Part state names array model/0.weight"):
        user.array_names(rec, "stateful/part")
    ok: Any = {"kind": "job.Part", "state": {"list": [{"tensor": "stateful/part/0"}, 1.5]}}
    assert user.array_names(ok, "stateful/part") == ["stateful/part/0"]
    assert json.dumps(ok)  # a record is plain JSON
