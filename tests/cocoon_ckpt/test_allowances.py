"""ResumeAllowances: the resume checks a user lifts, as one value, the only way
`run_job`/`open_job` take them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.runner import run_job
from state import CorruptVersionError, Store
from state.manifest import manifest_path
from tests.cocoon_ckpt.conftest import job_config


def test_only_bools_are_allowed() -> None:
    with pytest.raises(ConfigError, match=r"^ResumeAllowances\.fallback=1 is not a bool"):
        ResumeAllowances(fallback=1)  # type: ignore[arg-type]


def test_the_old_keyword_flags_are_gone() -> None:
    with pytest.raises(TypeError, match="allow_fallback"):
        run_job(job_config("mlp"), "memory://never", allow_fallback=True)  # type: ignore[call-arg]


def test_a_damaged_newest_version_resumes_from_the_older_only_when_allowed(
    tmp_path: Path,
) -> None:
    config = job_config("mlp", bands=2, steps=10)  # versions at steps 5 and 10
    url, key = str(tmp_path / "run.zarr"), str(tmp_path / "k")
    run_job(config, url, options=JobOptions(key_file=key))
    store = Store.open(url, create=False)
    newest = store.versions()[-1]
    path = Path(store.backend.path(manifest_path(newest)))
    path.write_bytes(path.read_bytes().replace(b'"step": 10', b'"step": 11', 1))
    with pytest.raises(CorruptVersionError):
        run_job(config, url, options=JobOptions(key_file=key))
    result = run_job(
        config, url, options=JobOptions(key_file=key, allow=ResumeAllowances(fallback=True))
    )
    assert result.resumed_from == 5 and result.steps_done == 10
