"""A job starts in one pass: the store is opened once, a target epsilon is calibrated
once, the start produces one named value (`StartedJob`), and `JobOptions` is the one way
to say how a job runs against its store."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cocoon_ckpt
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
from cocoon_ckpt.errors import CocoonError, ConfigError, ConfigMismatchError
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train import build as build_mod
from cocoon_ckpt.train import target_epsilon as te
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.runner import run_job
from cocoon_ckpt.train.start import StartedJob, start_job
from cocoon_ckpt.train.trainer import DPTrainer
from state import Store
from tests.cocoon_ckpt.conftest import job_config, tree


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, bool, bool]]]:
    """Every `Store.open` call: (url, create, whether it returned a store)."""
    calls: list[tuple[str, bool, bool]] = []
    real = Store.open.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Store], url: str, **kw: Any) -> Store:
        try:
            store: Store = real(cls, url, **kw)
        except Exception:
            calls.append((url, kw.get("create", True), False))
            raise
        calls.append((url, kw.get("create", True), True))
        return store

    monkeypatch.setattr(Store, "open", classmethod(counted))
    yield calls


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The targets sigma is calibrated for (`noise_multiplier_for` as the start calls it)."""
    calls: list[float] = []

    def counted(target: float, *args: Any) -> float:
        calls.append(target)
        return noise_multiplier_for(target, *args)

    monkeypatch.setattr(te, "noise_multiplier_for", counted)
    return calls


def _target_job(steps: int = 10) -> Any:
    cfg = job_config(bands=4, steps=steps)
    dp = dataclasses.replace(cfg.dp, noise_multiplier=None, target_epsilon=6.0)
    return dataclasses.replace(cfg, dp=dp)


def test_a_target_job_opens_its_store_once_and_calibrates_once(
    tmp_path: Path, opens: list[tuple[str, bool, bool]], calibrations: list[float]
) -> None:
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    options = JobOptions(key_file=key)
    run_job(_target_job(), url, options=options, stop_after=5)
    # a new store: one look that finds none, then the one open that creates it
    assert opens == [(url, False, False), (url, True, True)]
    assert calibrations == [6.0]
    opens.clear()
    result = run_job(_target_job(), url, options=options)
    assert result.resumed_from == 5 and result.steps_done == 10
    assert opens == [(url, False, True)]  # the resume: one open, its sigma read there
    assert calibrations == [6.0]  # the stored sigma, not calibrated again
    dp = Store.open(url, create=False).latest().records["config"]["dp"]  # type: ignore[union-attr]
    assert dp["target_epsilon"] == 6.0 and isinstance(dp["noise_multiplier"], float)


def test_the_cli_hands_over_once_and_opens_the_store_once(
    tmp_path: Path,
    opens: list[tuple[str, bool, bool]],
    calibrations: list[float],
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    argv = ["train", "--store", store, "--key-file", key, "--steps", "6", "--bands", "2"]
    argv += ["--target-epsilon", "6", "--checkpoint-every", "3", "--no-progress"]
    assert main(argv) == 0
    assert [o for o in opens if o[2]] == [(store, True, True)]
    assert calibrations == [6.0]
    opens.clear()
    assert main(argv) == 0  # finished: the same command resumes at its end
    assert opens == [(store, False, True)] and calibrations == [6.0]
    capsys.readouterr()


def test_the_start_is_one_named_value(tmp_path: Path) -> None:
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    allow = ResumeAllowances(generator_change=True)
    leased: list[Store] = []
    job = start_job(
        _target_job(),
        url,
        None,
        JobOptions(key_file=key, allow=allow),
        dist=None,
        leased=leased,
    )
    try:
        assert isinstance(job, StartedJob)
        assert job.config.dp.is_calibrated and job.config.dp.noise_multiplier is not None
        assert job.version is None and job.coordinator and job.allow is allow
        assert job.key == Path(key).read_bytes()
        assert leased == [job.store] and job.store.lease is not None
        assert job.trainer.config.sigma == job.config.dp.sigma
        with pytest.raises(dataclasses.FrozenInstanceError):
            job.version = None  # type: ignore[misc]
    finally:
        job.trainer.close()
        job.store.release_lease()


def test_a_resume_that_changes_the_target_is_refused_before_any_write(
    tmp_path: Path, calibrations: list[float]
) -> None:
    url, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    run_job(_target_job(), url, options=JobOptions(key_file=key), stop_after=5)
    before = tree(tmp_path)
    other = _target_job()
    other = dataclasses.replace(other, dp=dataclasses.replace(other.dp, target_epsilon=7.0))
    with pytest.raises(ConfigMismatchError, match="dp.target_epsilon: stored 6.0, now 7.0"):
        run_job(other, url, options=JobOptions(key_file=key))
    assert calibrations == [6.0] and tree(tmp_path) == before


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("key_file", "", "JobOptions.key_file='' is not a path"),
        ("key_file", 3, "JobOptions.key_file=3 is not a path"),
        ("storage_options", "x", "JobOptions.storage_options='x' is not a dict"),
        ("takeover", 1, "JobOptions.takeover=1 is not a bool"),
        ("allow", True, "JobOptions.allow=True is not a ResumeAllowances"),
        ("on_precompute", 5, "JobOptions.on_precompute=5 is not callable"),
    ],
)
def test_job_options_name_the_field_and_the_fix(field: str, value: Any, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        JobOptions(**{field: value})
    text = str(caught.value)
    assert text.startswith(words) and "\n" not in text and "; " in text


def test_job_options_is_public_and_the_old_keywords_are_gone(tmp_path: Path) -> None:
    assert cocoon_ckpt.JobOptions is JobOptions
    url = str(tmp_path / "s.zarr")
    for old in ("key_file", "takeover", "fs", "storage_options", "allow", "builder"):
        with pytest.raises(TypeError, match=old):
            run_job(job_config(), url, **{old: None})
        with pytest.raises(TypeError, match=old):
            cocoon_ckpt.open_job(job_config(), url, **{old: None})
    assert not Path(url).exists()


def test_a_start_builds_and_checks_the_parts_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks: list[str] = []
    real = build_mod.check_parts

    def counted(config: Any, parts: Any) -> None:
        checks.append(config.job)
        real(config, parts)

    monkeypatch.setattr(build_mod, "check_parts", counted)
    built: list[int] = []

    def builder(config: Any) -> Any:
        built.append(config.dp.steps)
        return mlp.build(config)

    url, options = str(tmp_path / "s.zarr"), JobOptions(key_file=str(tmp_path / "k"))
    run_job(_target_job(), url, builder, options=options, stop_after=5)
    assert built == [10] and checks == ["example:mlp"]  # a new job
    run_job(_target_job(), url, builder, options=options)
    assert built == [10, 10] and len(checks) == 2  # and its resume: once each


@pytest.mark.parametrize("fault", ["scheduler", "batchnorm"])
def test_the_trainer_and_a_start_refuse_a_model_by_one_definition(
    tmp_path: Path, fault: str
) -> None:
    config = job_config(bands=2, steps=4)

    def builder(cfg: Any) -> Any:
        parts = mlp.build(cfg)
        if fault == "scheduler":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(parts.optimizer)
            return dataclasses.replace(parts, scheduler=sched)
        model = torch.nn.Sequential(torch.nn.BatchNorm1d(20), *parts.model)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
        return dataclasses.replace(parts, model=model, optimizer=opt)

    parts = builder(config)
    with pytest.raises(CocoonError) as direct:
        DPTrainer(
            parts.model,
            parts.optimizer,
            parts.loss_fn,
            parts.dataset,
            config.dp,
            bytes(32),
            scheduler=parts.scheduler,
        )
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CocoonError) as started:
        run_job(config, str(out / "s.zarr"), builder, options=JobOptions(key_file=str(out / "k")))
    assert type(started.value) is type(direct.value)
    assert str(started.value) == str(direct.value)
    assert not list(out.iterdir())  # refused before anything was written
