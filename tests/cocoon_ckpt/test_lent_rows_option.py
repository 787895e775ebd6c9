"""`JobOptions.lent_rows` and `--lent-rows`: the memory-first choice of
`Checkpointer(lent_rows=...)` reaches a job started through `open_job`, `run_job` and
the CLI; a bad value is refused before anything is written; both choices store the
same bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from cocoon_ckpt import open_job, run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.examples import mlp as mlp_job
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .conftest import job_config, tree


def _stored(url: str) -> dict[str, bytes]:
    """Every array of the newest version, as bytes, by name."""
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    return {n: latest.array(n).tobytes() for n in latest.array_names()}


def test_a_bad_policy_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"JobOptions\.lent_rows='keep'.*\"wait\""):
        JobOptions(lent_rows="keep")  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["copy", "wait"])
def test_open_job_hands_the_policy_to_its_checkpointer(tmp_path: Path, policy: str) -> None:
    cfg = job_config(bands=4, steps=6)
    options = JobOptions(key_file=str(tmp_path / "k"), lent_rows=policy)  # type: ignore[arg-type]
    with open_job(cfg, str(tmp_path / "s.zarr"), mlp_job.build(cfg), options=options) as job:
        assert job._ckpt._lent.on_overwrite == policy
        for _ in job.steps():
            pass


def test_both_policies_store_the_same_bytes(tmp_path: Path) -> None:
    # b = 4, k = 5: every version lends its ring rows and the ring reaches them before
    # the next checkpoint (2k >= b)
    cfg, key = job_config(bands=4, steps=12), str(tmp_path / "noise.key")
    copy, wait = str(tmp_path / "copy.zarr"), str(tmp_path / "wait.zarr")
    run_job(cfg, copy, options=JobOptions(key_file=key, lent_rows="copy"))
    run_job(cfg, wait, options=JobOptions(key_file=key, lent_rows="wait"))
    a, b = _stored(copy), _stored(wait)
    assert a.keys() == b.keys() and all(a[n] == b[n] for n in a)


def test_the_cli_takes_the_policy_and_refuses_another(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["--steps", "4", "--bands", "2", "--checkpoint-every", "2", "--no-progress"]
    store = str(tmp_path / "s.zarr")
    assert main(["train", "--store", store, "--lent-rows", "wait", *small]) == 0
    before = tree(tmp_path)
    capsys.readouterr()
    assert main(["train", "--store", store, "--lent-rows", "keep", *small]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lent-rows" in err and "'wait'" in err
    assert tree(tmp_path) == before
