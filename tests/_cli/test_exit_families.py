"""The exit code says what happened: 2 a malformed request, 1 a refusal by the state of
the store, FAILURE (3) a valid request that failed while it ran. Every error of
`cocoon_ckpt.errors` is in one family, and one case of each family runs through the
real command line (`tests._cli.family_jobs`), writing nothing it should not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import cocoon_ckpt.errors as errors
from cocoon_ckpt._cli.exits import FAILURE, exit_code
from cocoon_ckpt.errors import CocoonError, PreemptedError, RefusedError, RequestError, RunError

from ..cocoon_ckpt.conftest import tree

ROOT = Path(__file__).parents[2]
FAMILIES: dict[type[CocoonError], int] = {RequestError: 2, RefusedError: 1, RunError: FAILURE}


def _train(store: Path, key: Path, fault: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "cocoon_ckpt", "train", "--job", "tests._cli.family_jobs:build"]
    argv += ["--store", str(store), "--key-file", str(key), "--steps", "4", "--bands", "2"]
    argv += ["--checkpoint-every", "2", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAMILY_FAULT": fault}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_every_error_of_ours_is_in_one_family_and_exits_with_its_code() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        if cls in (CocoonError, PreemptedError):  # the base, and a signal's 128 + N
            continue
        families = [f for f in FAMILIES if issubclass(cls, f)]
        assert len(families) == 1, (name, families)
        exc = cls.__new__(cls)  # the exit code depends on the class alone
        Exception.__init__(exc, "x")
        assert exit_code(exc) == FAMILIES[families[0]], name


def test_a_failure_has_a_code_of_its_own() -> None:
    assert FAILURE not in (0, 1, 2) and FAILURE < 128
    assert exit_code(RuntimeError("not ours")) == FAILURE


def test_a_malformed_request_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    store, key = tmp_path / "s.zarr", tmp_path / "k"
    run = _train(store, key, "not_parts")
    assert run.returncode == 2, run.stderr
    assert "returned Sequential, not JobParts" in run.stderr and run.stderr.count("\n") == 1
    assert not store.exists() and not key.exists()


def test_a_stored_state_the_job_disagrees_with_exits_1_and_writes_nothing(
    tmp_path: Path,
) -> None:
    store, key = tmp_path / "s.zarr", tmp_path / "k"
    first = _train(store, key, "")
    assert first.returncode == 0, first.stderr
    before = tree(store)
    run = _train(store, key, "stateful")  # the same config, a part under another name
    assert run.returncode == 1, run.stderr
    assert f"version 2 of {store}: the stored stateful parts are" in run.stderr
    assert run.stderr.count("\n") == 1
    assert tree(store) == before


def test_a_run_that_fails_exits_with_the_failure_code_and_commits_nothing(
    tmp_path: Path,
) -> None:
    store, key = tmp_path / "s.zarr", tmp_path / "k"
    run = _train(store, key, "nan")
    assert run.returncode == FAILURE, run.stderr
    assert "step 0: the per-sample gradient" in run.stderr and "not finite" in run.stderr
    assert not [p for p in (store / "versions").iterdir() if p.is_dir()]
