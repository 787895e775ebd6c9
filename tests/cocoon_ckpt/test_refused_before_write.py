"""Every refusal of a new job comes before its first write: step 0's batch is drawn,
collated and checked, and the optimizer's step() signature checked, before the store,
the key or the lease exists.

Each case hashes the tree (paths, modes, bytes) of the folder that would hold the store
and the key file before and after the refused `run_job`.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt.errors import ConfigError, NoiseKeyError
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.build import check_first_batch
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts, check_optimizer_step, make_optimizer

from .conftest import tree


def _config(optimizer: str = "sgd") -> JobConfig:
    dp = DPConfig(steps=4, bands=2, batch_size=16, dataset_size=256, noise_multiplier=1.0)
    return JobConfig(job="own:build", dp=dp, optimizer=optimizer, checkpoint_every=2)


class _Items(Dataset[Any]):
    """The example's data, each item made by `item(x, y)`."""

    def __init__(self, n: int, item: Any) -> None:
        self.x, self.y = mlp.make_data(n, 20, 4, 0)
        self.item = item

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Any:
        return self.item(self.x[i], self.y[i])


def _with(config: JobConfig, **changes: Any) -> JobParts:
    parts = mlp.build(config)
    fields = {"model": parts.model, "optimizer": parts.optimizer, "loss_fn": parts.loss_fn}
    fields.update(changes)
    if "dataset" not in changes:
        fields["dataset"] = parts.dataset
    return JobParts(**fields)


class _NeedsClosure(torch.optim.SGD):
    """A job's own optimizer whose step() requires a closure, as LBFGS's does."""

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        return super().step(closure)


def _refused(tmp_path: Path, config: JobConfig, build: Any, match: str) -> str:
    """Run the refused job into tmp_path/out; the message, and nothing written there."""
    out = tmp_path / "out"
    (out / "keys").mkdir(parents=True)
    before = tree(out)
    with pytest.raises(ConfigError, match=match) as exc:
        run_job(
            config, str(out / "s.zarr"), build, options=JobOptions(key_file=str(out / "keys/k"))
        )
    assert tree(out) == before
    return str(exc.value)


def test_a_dataset_of_dicts_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    def build(config: JobConfig) -> JobParts:
        return _with(config, dataset=_Items(256, lambda x, y: {"x": x, "y": y}))

    msg = _refused(tmp_path, _config(), build, "got dict")
    assert "_Items" in msg and "tuples of tensors" in msg


def test_a_dataset_of_one_tensor_items_is_refused(tmp_path: Path) -> None:
    def build(config: JobConfig) -> JobParts:
        return _with(config, dataset=_Items(256, lambda x, y: (x,)))

    msg = _refused(tmp_path, _config(), build, "collate to 1 tensor")
    assert "(inputs..., target)" in msg


def test_a_collate_fn_returning_a_dict_is_refused(tmp_path: Path) -> None:
    def collate(items: list[Any]) -> Any:
        return {"x": torch.stack([i[0] for i in items]), "y": torch.stack([i[1] for i in items])}

    def build(config: JobConfig) -> JobParts:
        return _with(config, dataset=_Items(256, lambda x, y: (x, y)), collate_fn=collate)

    _refused(tmp_path, _config(), build, "got dict.*collate_fn")


def test_an_error_in_the_users_getitem_is_raised_as_it_is(tmp_path: Path) -> None:
    def bad(x: torch.Tensor, y: torch.Tensor) -> Any:
        raise ValueError("bad record 7")

    def build(config: JobConfig) -> JobParts:
        return _with(config, dataset=_Items(256, bad))

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="^bad record 7$"):
        run_job(_config(), str(out / "s.zarr"), parts=build)
    assert tree(out) == {}


def test_lbfgs_is_refused_by_name_before_anything_is_written(tmp_path: Path) -> None:
    def build(config: JobConfig) -> JobParts:
        return mlp.build(config)  # make_optimizer("lbfgs", ...)

    msg = _refused(tmp_path, _config("lbfgs"), build, r"LBFGS\.step\(\) needs closure")
    assert "sgd, adam" in msg


def test_a_custom_optimizer_that_needs_a_closure_is_refused(tmp_path: Path) -> None:
    def build(config: JobConfig) -> JobParts:
        parts = _with(dataclasses.replace(config, optimizer="sgd"))
        opt = _NeedsClosure(parts.model.parameters(), lr=config.lr)
        return dataclasses.replace(parts, optimizer=opt)

    _refused(tmp_path, _config("custom"), build, r"_NeedsClosure\.step\(\) needs closure")


def test_every_torch_optimizer_but_lbfgs_steps_without_a_closure() -> None:
    p = [nn.Parameter(torch.zeros(2))]
    refused = []
    for name in ("sgd", "adam", "adamw", "adagrad", "rmsprop", "lbfgs"):
        try:
            check_optimizer_step(make_optimizer(name, p, 0.1), name)
        except ConfigError:
            refused.append(name)
    assert refused == ["lbfgs"]


def test_a_key_file_in_a_missing_folder_is_refused_before_the_store(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(NoiseKeyError, match="folder .*nowhere does not exist"):
        run_job(_config(), str(out / "s.zarr"), options=JobOptions(key_file=str(out / "nowhere/k")))
    assert tree(out) == {}


def test_the_first_batch_check_leaves_the_global_generators_as_they_were() -> None:
    config = _config()
    parts = mlp.build(config)
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    states = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    check_first_batch(config, parts)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert random.getstate() == states[2]
