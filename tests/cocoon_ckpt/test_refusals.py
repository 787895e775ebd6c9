"""A refused or failed start changes nothing, and bad numbers are refused by name.

Each case hashes the tree (paths, bytes, modes) around the store and the key file
before and after the refused `run_job`: nothing created, nothing written, no lease
generation added, no running writer fenced.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt.errors import (
    ConfigError,
    ConfigMismatchError,
    GeneratorMismatchError,
    NoiseKeyError,
)
from cocoon_ckpt.keys import create_key_file, key_id, read_key_file
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from state import CorruptVersionError, Store

from .conftest import job_config, reseal, tree


def _small(**kw: Any) -> JobConfig:
    return job_config(bands=2, steps=4, **kw)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two committed 4-step stores: one keeping its key inside, one with a key file."""
    root = tmp_path_factory.mktemp("committed")
    run_job(_small(), str(root / "s.zarr"))
    run_job(_small(), str(root / "k.zarr"), options=JobOptions(key_file=str(root / "noise.key")))
    return root


@pytest.fixture()
def work(stores: Path, tmp_path: Path) -> Path:
    shutil.copytree(stores, tmp_path / "w", symlinks=True)
    return tmp_path / "w"


def _failing_builder(config: JobConfig) -> JobParts:
    raise RuntimeError("the user's builder failed")


def test_refused_resume_for_a_config_mismatch_changes_nothing(work: Path) -> None:
    before = tree(work)
    with pytest.raises(ConfigMismatchError, match=r"dp.bands: stored 2, now 1"):
        run_job(job_config(bands=1, steps=4), str(work / "s.zarr"))
    assert tree(work) == before  # no lease generation, no key, nothing


def test_takeover_refused_for_a_mismatch_does_not_fence_the_running_writer(work: Path) -> None:
    holder = Store.open(str(work / "s.zarr"), create=False)
    lease = holder.acquire_lease()  # this process is the healthy running writer
    before = tree(work)
    with pytest.raises(ConfigMismatchError):
        run_job(
            job_config(bands=1, steps=4), str(work / "s.zarr"), options=JobOptions(takeover=True)
        )
    assert tree(work) == before
    lease.check()  # still the store's writer: not fenced
    holder.release_lease()


def test_failing_builder_creates_no_store_and_no_key(tmp_path: Path) -> None:
    for key_file in (None, str(tmp_path / "noise.key")):
        with pytest.raises(RuntimeError, match="builder failed"):
            run_job(
                _small(),
                str(tmp_path / "new.zarr"),
                parts=_failing_builder,
                options=JobOptions(key_file=key_file),
            )
        assert list(tmp_path.iterdir()) == []


def test_failing_builder_on_resume_changes_nothing(work: Path) -> None:
    before = tree(work)
    with pytest.raises(RuntimeError, match="builder failed"):
        run_job(_small(), str(work / "s.zarr"), parts=_failing_builder)
    assert tree(work) == before


def test_builder_with_a_wrong_signature_is_named(tmp_path: Path) -> None:
    def no_args() -> JobParts:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="function of one argument, the JobConfig"):
        run_job(_small(), str(tmp_path / "new.zarr"), parts=no_args)
    assert list(tmp_path.iterdir()) == []


def test_bad_key_files_are_refused_before_anything_is_written(work: Path) -> None:
    key = work / "noise.key"
    store = str(work / "k.zarr")
    os.chmod(key, 0o640)
    before = tree(work)
    for url in (store, str(work / "fresh.zarr")):  # a resume, and a new job
        with pytest.raises(NoiseKeyError, match=f"chmod 600 {key}"):
            run_job(_small(), url, options=JobOptions(key_file=str(key)))
        assert tree(work) == before
    short = work / "short.key"
    short.write_bytes(b"x" * 16)
    os.chmod(short, 0o600)
    before = tree(work)
    with pytest.raises(NoiseKeyError, match="holds 16 bytes"):
        run_job(_small(), str(work / "fresh.zarr"), options=JobOptions(key_file=str(short)))
    with pytest.raises(NoiseKeyError, match="--key-file"):  # the key lives outside the store
        run_job(_small(), store)
    with pytest.raises(NoiseKeyError, match="cannot read key file"):
        run_job(_small(), store, options=JobOptions(key_file=str(work / "missing.key")))
    assert tree(work) == before


def test_another_jobs_key_is_refused(work: Path) -> None:
    other = work / "other.key"
    create_key_file(str(other), b"o" * 32)
    before = tree(work)
    with pytest.raises(NoiseKeyError, match="does not match the key of version"):
        run_job(_small(), str(work / "k.zarr"), options=JobOptions(key_file=str(other)))
    assert tree(work) == before


def _tamper(store: Path, edit: Any) -> None:
    """Rewrite the newest manifest's records and re-stamp its checksums and MACs (a
    writer who holds the store's key: the checks behind the MACs; one without it is
    refused by the MACs first, test_forged_records)."""
    path = sorted((store / "manifests").glob("*.json"))[-1]
    doc = json.loads(path.read_bytes())
    edit(doc["records"])
    path.write_bytes(reseal(doc, store))


@pytest.mark.parametrize(
    ("edit", "error", "needle"),
    [
        (lambda r: r["noise"].update(shards=5), CorruptVersionError, "record is malformed"),
        (lambda r: r.update(optimizer=[]), CorruptVersionError, "record is malformed"),
        (lambda r: r["trainer"].update(step="7"), CorruptVersionError, "record is malformed"),
        (lambda r: r.pop("model_shapes"), CorruptVersionError, "record is malformed"),
        (lambda r: r["generator"].update(torch="0.0.1"), GeneratorMismatchError, "generator"),
    ],
    ids=["shards-int", "optimizer-list", "step-str", "no-shapes", "generator"],
)
def test_hostile_records_are_refused_by_name_and_change_nothing(
    work: Path, edit: Any, error: type[Exception], needle: str
) -> None:
    _tamper(work / "s.zarr", edit)
    before = tree(work)
    with pytest.raises(error, match=needle):
        run_job(_small(), str(work / "s.zarr"))
    assert tree(work) == before


def test_a_fresh_job_keeps_a_new_key_file_private(tmp_path: Path) -> None:
    key = tmp_path / "noise.key"
    old = os.umask(0)
    try:
        run_job(_small(), str(tmp_path / "s.zarr"), options=JobOptions(key_file=str(key)))
    finally:
        os.umask(old)
    assert key.stat().st_mode & 0o777 == 0o600
    kid = Store.open(str(tmp_path / "s.zarr"), create=False).latest()
    assert kid is not None and kid.records["key_id"] == key_id(read_key_file(str(key)))


_DP = {"steps": 4, "batch_size": 8, "dataset_size": 64, "noise_multiplier": 1.0}


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("steps", 10**30, "an integer in"),
        ("steps", 4.0, "an integer in"),
        ("steps", True, "an integer in"),
        ("bands", 0, "an integer in"),
        ("batch_size", -1, "an integer in"),
        ("dataset_size", "64", "an integer in"),
        ("noise_multiplier", math.inf, r"lie in \[0\.3, 1e\+08\]"),
        ("noise_multiplier", math.nan, r"lie in \[0\.3, 1e\+08\]"),
        ("noise_multiplier", "1", r"lie in \[0\.3, 1e\+08\]"),
        ("max_grad_norm", 0.0, "finite and > 0"),
        ("delta", 1.0, "lie in"),
        ("delta", math.nan, "lie in"),
        ("seed", -1, "an integer in"),
        ("mechanism", "best", "be one of"),
    ],
)
def test_dp_config_refuses_bad_numbers_by_name(field: str, value: Any, rule: str) -> None:
    with pytest.raises(ConfigError, match=rf"^Expected DPConfig\.{field}=.* to (be )?{rule}"):
        DPConfig(**{**_DP, field: value})


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("lr", math.inf, "finite and > 0"),
        ("lr", -0.1, "finite and > 0"),
        ("lr", math.nan, "finite and > 0"),
        ("async_checkpoint", "no", "be true or false"),
        ("overlap_noise", 1, "be true or false"),
        ("checkpoint_every", 0, "an integer in"),
        ("keep_last", 1, "an integer in"),
        ("log_level", "BOGUS", "be one of"),
        ("optimizer", "lion", "be one of"),
        ("options", [], "be a JSON object"),
        ("job", "", "be a non-empty string"),
        ("job", "nocolon", "be 'example:NAME'"),
    ],
)
def test_job_config_refuses_bad_values_by_name(field: str, value: Any, rule: str) -> None:
    dp = DPConfig(**_DP)
    kw: dict[str, Any] = {"job": "example:mlp", "dp": dp, field: value}
    with pytest.raises(ConfigError, match=rf"^Expected JobConfig\.{field}=.* to (be )?{rule}"):
        JobConfig(**kw)


def test_config_records_of_the_wrong_shape_are_named() -> None:
    rec = _small().to_record()
    with pytest.raises(ConfigError, match="unknown field.*bogus"):
        JobConfig.from_record({**rec, "dp": {**rec["dp"], "bogus": 1}})
    with pytest.raises(ConfigError, match="missing field.*noise_multiplier"):
        JobConfig.from_record(
            {**rec, "dp": {k: v for k, v in rec["dp"].items() if k != "noise_multiplier"}}
        )
    with pytest.raises(ConfigError, match="Expected tiers=.* to be a JSON object"):
        JobConfig.from_record({**rec, "tiers": 3})
    with pytest.raises(ConfigError, match="async_checkpoint='no'"):
        JobConfig.from_record({**rec, "async_checkpoint": "no"})


def test_an_empty_store_url_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="store_url"):
        run_job(_small(), "")
    assert list(tmp_path.iterdir()) == []
