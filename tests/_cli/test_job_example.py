"""`--job example:NAME` is the name a store and a --config file give a built-in example:
on the command line it runs the job `--example NAME` runs, not the example's builder
treated as a user's job (which read its dataset size from a probe build)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cocoon_ckpt._cli.main import parser
from cocoon_ckpt._cli.train_config import EXAMPLE_NAMES, train_config


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
@pytest.mark.parametrize("extra", [[], ["--steps", "40", "--lr", "0.25"]])
def test_job_example_is_the_example(name: str, extra: list[str]) -> None:
    as_job = train_config(parser().parse_args(["train", "--job", f"example:{name}", *extra]))
    as_example = train_config(parser().parse_args(["train", "--example", name, *extra]))
    assert as_job == as_example
    assert as_job[0].job == f"example:{name}"


def test_an_unknown_example_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "s"
    done = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "train", "--job", "example:nope"]
        + ["--store", str(store), "--steps", "20"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "example:nope" in lines[0] and "example:mlp" in lines[0]
    assert not store.exists()
