"""Every default the CLI shows or applies is the config dataclasses' own (or, where the
CLI chooses its own example sizes, named as such), so the two cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from cocoon_ckpt._cli.audit import COORDINATES
from cocoon_ckpt._cli.main import parser
from cocoon_ckpt._cli.train_config import EXAMPLE_DEFAULTS, JOB_FLAGS, train_config
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.train.config import DPConfig, JobConfig


def _defaults(cls: type) -> dict[str, object]:
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
    }


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]  # type: ignore[no-any-return]


def _help(name: str, flag: str) -> str:
    action = next(a for a in _subparser(name)._actions if flag in a.option_strings)
    return " ".join((action.help or "").split())


def test_train_without_flags_is_the_dataclass_defaults_with_the_example_sizes() -> None:
    config, store = train_config(parser().parse_args(["train"]))
    sizes = {JOB_FLAGS[k].removeprefix("dp."): v for k, v in EXAMPLE_DEFAULTS.items()}
    assert config == JobConfig(job="example:mlp", dp=DPConfig(**sizes))
    assert store == "runs/mlp.zarr"


@pytest.mark.parametrize("flag", [k for k in JOB_FLAGS if k not in EXAMPLE_DEFAULTS])
def test_every_job_flag_shows_its_dataclass_default(flag: str) -> None:
    section, _, name = JOB_FLAGS[flag].rpartition(".")
    default = _defaults(DPConfig if section == "dp" else JobConfig)[name]
    shown = getattr(default, "value", default)
    assert f"(default {shown})" in _help("train", "--" + flag.replace("_", "-"))


@pytest.mark.parametrize("flag", EXAMPLE_DEFAULTS)
def test_the_example_sizes_are_shown(flag: str) -> None:
    assert f"(default {EXAMPLE_DEFAULTS[flag]})" in _help("train", "--" + flag.replace("_", "-"))


def test_harmless_flags_and_log_level_show_the_jobconfig_defaults() -> None:
    job = _defaults(JobConfig)
    assert f"(default {job['checkpoint_every']})" in _help("train", "--checkpoint-every")
    assert f"(default {job['lease_expiry_s']})" in _help("train", "--lease-expiry")
    assert parser().parse_args(["inspect", "x"]).log_level == job["log_level"]
    assert f"(default {job['log_level']};" in " ".join(parser().format_help().split())


def test_one_embedding_flag_leaves_the_others_to_embeddingconfig() -> None:
    args = parser().parse_args(["train", "--embedding", "dense"])
    config, _ = train_config(args)
    assert config.embedding == EmbeddingConfig(mode=TableMode.DENSE)
    args = parser().parse_args(["train", "--threat-model", "final_model"])
    assert train_config(args)[0].embedding == EmbeddingConfig(threat_model="final_model")


def test_audit_coordinates_is_audit_stores_default() -> None:
    from cocoon_ckpt.tools.audit import audit_store

    assert COORDINATES == inspect.signature(audit_store).parameters["coordinates"].default
    assert parser().parse_args(["audit", "x"]).coordinates == COORDINATES
