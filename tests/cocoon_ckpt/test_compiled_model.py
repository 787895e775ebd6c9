"""A `torch.compile`d model: stored and exported under the plain model's names, so a
store resumes with or without compiling and the export loads into the plain model.

backend="eager" wraps the model in the same OptimizedModule (the `_orig_mod.` prefix is
the thing under test) without needing a C++ compiler or compile time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import pytest
import torch
from torch import nn

from cocoon_ckpt import export_model, run_job
from cocoon_ckpt._state_dict import COMPILED_PREFIX, plain_keys, uncompiled
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train import parts as parts_module
from cocoon_ckpt.train import trainer as trainer_module
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import Store

from .conftest import job_config


def _compile(model: nn.Module) -> nn.Module:
    return cast("nn.Module", torch.compile(model, backend="eager"))


def _compiled(config: JobConfig) -> JobParts:
    parts = mlp.build(config)
    return dataclasses.replace(parts, model=_compile(parts.model))


def _plain_model(config: JobConfig) -> nn.Module:
    return mlp.build(config).model


def _export(url: str, out: Path) -> dict[str, torch.Tensor]:
    export_model(url, str(out))
    return torch.load(out)  # type: ignore[no-any-return]


def test_job_parts_keep_the_module_a_compiled_model_wraps() -> None:
    cfg = job_config("mlp", bands=2, steps=4)
    plain = mlp.build(cfg)
    compiled = _compile(plain.model)
    assert next(iter(compiled.state_dict())).startswith(COMPILED_PREFIX)
    parts = dataclasses.replace(plain, model=compiled)
    assert parts.model is plain.model and uncompiled(compiled) is plain.model
    assert not any(k.startswith(COMPILED_PREFIX) for k in parts.model.state_dict())
    assert uncompiled(plain.model) is plain.model


@pytest.mark.parametrize(("first", "then"), [("compiled", "plain"), ("plain", "compiled")])
def test_a_store_resumes_across_compiling_bit_identical(
    tmp_path: Path, first: str, then: str
) -> None:
    builders = {"compiled": _compiled, "plain": mlp.build}
    cfg = job_config("mlp", bands=4, steps=12)
    key = str(tmp_path / "k")
    run_job(cfg, str(tmp_path / "gold.zarr"), options=JobOptions(key_file=key))
    gold = _export(str(tmp_path / "gold.zarr"), tmp_path / "gold.pt")
    url = str(tmp_path / "run.zarr")
    run_job(cfg, url, parts=builders[first], stop_after=7, options=JobOptions(key_file=key))
    shapes = Store.open(url, create=False).latest().records["model_shapes"]  # type: ignore[union-attr]
    assert set(shapes) == set(gold)  # no `_orig_mod.` in what the store records
    res = run_job(cfg, url, parts=builders[then], options=JobOptions(key_file=key))
    assert res.resumed_from == 5
    got = _export(url, tmp_path / "got.pt")
    assert set(got) == set(gold) and all(torch.equal(gold[k], got[k]) for k in gold)
    _plain_model(cfg).load_state_dict(got)  # strict: every key the plain model has


def test_export_of_a_store_with_prefixed_names_loads_into_the_plain_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a store written before JobParts unwrapped compiled models: the trainer saw the
    # OptimizedModule, so the versions name every parameter `_orig_mod.<name>` (both
    # places that now unwrap are undone)
    monkeypatch.setattr(parts_module, "uncompiled", lambda model: model)
    monkeypatch.setattr(trainer_module, "uncompiled", lambda model: model)
    cfg = job_config("mlp", bands=2, steps=4)
    url = str(tmp_path / "old.zarr")
    run_job(cfg, url, parts=_compiled, options=JobOptions(key_file=str(tmp_path / "k")))
    shapes = Store.open(url, create=False).latest().records["model_shapes"]  # type: ignore[union-attr]
    assert all(k.startswith(COMPILED_PREFIX) for k in shapes)
    state = _export(url, tmp_path / "m.pt")
    assert set(state) == {k.removeprefix(COMPILED_PREFIX) for k in shapes}
    _plain_model(cfg).load_state_dict(state)


def test_plain_keys_strips_the_prefix_and_refuses_a_key_twice() -> None:
    got = plain_keys({"_orig_mod.a": 1, "_orig_mod._orig_mod.b": 2, "c._orig_mod.d": 3}, "m")
    assert got == {"a": 1, "b": 2, "c._orig_mod.d": 3}  # a compiled submodule keeps its own
    with pytest.raises(ConfigError, match="keys '_orig_mod.a' and 'a' are one parameter"):
        plain_keys({"a": 1, "_orig_mod.a": 2}, "the model")
