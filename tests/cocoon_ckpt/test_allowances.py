"""ResumeAllowances: the resume checks a user lifts, as one value; the `allow_*` keyword
flags of `run_job`/`open_job` still work and add to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.runner import run_job
from state import CorruptVersionError, Store
from state.manifest import manifest_path
from tests.cocoon_ckpt.conftest import job_config


def test_only_bools_are_allowed() -> None:
    with pytest.raises(ConfigError, match=r"^ResumeAllowances\.fallback=1 is not a bool"):
        ResumeAllowances(fallback=1)  # type: ignore[arg-type]


def test_the_keyword_flags_add_to_the_allowances() -> None:
    none = ResumeAllowances()
    assert none.widened() == none
    assert none.widened(device_change=True) == ResumeAllowances(device_change=True)
    both = ResumeAllowances(fallback=True).widened(generator_change=True)
    assert both == ResumeAllowances(fallback=True, generator_change=True)
    assert ResumeAllowances(fallback=True).widened(fallback=False).fallback


@pytest.mark.parametrize(
    "allowed", [{"allow": ResumeAllowances(fallback=True)}, {"allow_fallback": True}]
)
def test_a_damaged_newest_version_resumes_from_the_older_only_when_allowed(
    tmp_path: Path, allowed: dict[str, Any]
) -> None:
    config = job_config("mlp", bands=2, steps=10)  # versions at steps 5 and 10
    url, key = str(tmp_path / "run.zarr"), str(tmp_path / "k")
    run_job(config, url, key_file=key)
    store = Store.open(url, create=False)
    newest = store.versions()[-1]
    path = Path(store.backend.path(manifest_path(newest)))
    path.write_bytes(path.read_bytes().replace(b'"step": 10', b'"step": 11', 1))
    with pytest.raises(CorruptVersionError):
        run_job(config, url, key_file=key)
    result = run_job(config, url, key_file=key, **allowed)
    assert result.resumed_from == 5 and result.steps_done == 10
