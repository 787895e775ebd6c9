"""`train --target-epsilon/--accountant` and `audit --delta`: the flags' defaults are the
dataclass fields', sigma and a target together are one line and exit 2, a small job
calibrates once and resumes with the recorded sigma, and epsilon at another delta is
dp-accounting's composition of the stored event."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
from dp_accounting import pld

from cocoon_ckpt._cli.exits import exit_code, message
from cocoon_ckpt._cli.main import parser
from cocoon_ckpt._cli.train_config import TARGET_FLAGS, add_target_flags, train_config
from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train import target_epsilon as te
from cocoon_ckpt.train.config import DPConfig
from state import Store


def _cli() -> argparse.ArgumentParser:
    """The real parser, its `train` command with the target flags (added here while
    `_cli/train.py` does not call `add_target_flags` itself)."""
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    train = sub.choices["train"]
    if "--target-epsilon" not in train._option_string_actions:
        add_target_flags(train)
    return p


def _run(argv: list[str]) -> int:
    args = _cli().parse_args(argv)
    try:
        return int(args.handler(args))
    except Exception as exc:
        print(f"cocoon-ckpt: error: {message(exc)}")
        return exit_code(exc)


@pytest.mark.parametrize("flag", TARGET_FLAGS)
def test_each_target_flag_shows_its_dataclass_default(flag: str) -> None:
    sub = next(a for a in _cli()._actions if isinstance(a, argparse._SubParsersAction))
    action = sub.choices["train"]._option_string_actions["--" + flag.replace("_", "-")]
    default = next(f.default for f in dataclasses.fields(DPConfig) if f.name == flag)
    assert f"(default {getattr(default, 'value', default)})" in " ".join(
        (action.help or "").split()
    )


def test_a_target_alone_drops_the_example_sigma_and_both_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = str(tmp_path / "s.zarr")
    args = _cli().parse_args(["train", "--store", store, "--accountant", "rdp"])
    config, _ = train_config(args)
    assert config.dp.noise_multiplier == 1.0 and config.dp.accountant == "rdp"
    both = ["train", "--store", store, "--noise-multiplier", "1", "--target-epsilon", "3"]
    with pytest.raises(ConfigError, match="^--noise-multiplier and --target-epsilon both"):
        train_config(_cli().parse_args(both))
    assert _run(both) == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "both given" in out
    assert not Path(store).exists()  # nothing written


def test_target_epsilon_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[float] = []

    def counted(target: float, *args: Any) -> float:
        calls.append(target)
        return noise_multiplier_for(target, *args)

    monkeypatch.setattr(te, "noise_multiplier_for", counted)
    store = str(tmp_path / "s.zarr")
    argv = ["train", "--store", store, "--steps", "8", "--bands", "4", "--dataset-size", "512"]
    argv += ["--target-epsilon", "5", "--checkpoint-every", "4", "--no-progress", "--json"]
    assert _run(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["steps"] == 8 and first["epsilon"] <= 5.0 and calls == [5.0]
    latest = Store.open(store, create=False).latest()
    assert latest is not None
    dp = latest.records["config"]["dp"]
    assert dp["target_epsilon"] == 5.0 and dp["noise_multiplier"] > 0
    # the same command resumes on the recorded sigma, with no calibration
    assert _run(argv) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 8 and calls == [5.0]
    # another target is another job: refused (exit 1), the difference named, no calibration
    versions = Store.open(store, create=False).versions()
    assert _run([*argv, "--target-epsilon", "6"]) == 1
    assert "dp.target_epsilon: stored 5.0, now 6.0" in capsys.readouterr().out
    assert calls == [5.0] and Store.open(store, create=False).versions() == versions
    # epsilon at another delta, from the stored event, as dp-accounting composes it
    audit = ["audit", store, "--coordinates", "4", "--seed", "0", "--json"]
    _run([*audit, "--delta", "1e-7", "--delta", "0.001"])
    report = json.loads(capsys.readouterr().out)
    assert not [f for f in report["findings"] if f["check"] == "accountant"]
    at = report["info"]["epsilon_at_delta"]
    q, count = 32 * 4 / 512, math.ceil(8 / 4)  # the CLI's example batch: 32
    for delta in (1e-7, 1e-3):
        acc = pld.PLDAccountant()
        event = dp_accounting.GaussianDpEvent(dp["noise_multiplier"])
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, event), count)
        assert at[f"delta={delta:g}"] == float(acc.get_epsilon(delta))
    assert at["version"] == latest.version and at["accounting_method"] == "pld"
