"""Target epsilon: exactly one of sigma and the target, sigma calibrated once and
recorded, reused on resume without a recalibration, a changed target refused with its
difference, and epsilon at any delta from the stored event (direct dp-accounting)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt.dp.accounting.accountant import Accountant
from cocoon_ckpt.dp.accounting.amplified import epsilon, epsilon_of_event
from cocoon_ckpt.dp.accounting.calibration import noise_multiplier_for
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError
from cocoon_ckpt.tools.guarantee import describe
from cocoon_ckpt.train import target_epsilon as te
from cocoon_ckpt.train.config import fingerprint
from state import Store

_DP: dict[str, Any] = {"steps": 12, "batch_size": 16, "dataset_size": 512, "bands": 4}
TARGET = 4.0


def _job(**dp: Any) -> JobConfig:
    kw = {**_DP, "target_epsilon": TARGET, **dp}
    return JobConfig(job="example:mlp", dp=DPConfig(**kw), checkpoint_every=4)


@pytest.fixture
def calibrations(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every calibration the job start runs, by target."""
    seen: list[float] = []

    def counted(target: float, *args: Any) -> float:
        seen.append(target)
        return noise_multiplier_for(target, *args)

    monkeypatch.setattr(te, "noise_multiplier_for", counted)
    return seen


def _direct(sigma: float, q: float, count: int, delta: float, method: str) -> float:
    acc = pld.PLDAccountant() if method == "pld" else rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
    return float(acc.get_epsilon(delta))


def test_exactly_one_of_sigma_and_target() -> None:
    with pytest.raises(ConfigError, match=r"^DPConfig: missing field noise_multiplier"):
        DPConfig(**_DP)
    with pytest.raises(
        ConfigError, match=r"^Expected DPConfig\.noise_multiplier=1\.0 to be None when target"
    ):
        DPConfig(**_DP, noise_multiplier=1.0, target_epsilon=3.0)
    with pytest.raises(ConfigError, match=r"^Expected DPConfig\.calibrated=True to come with"):
        DPConfig(**_DP, noise_multiplier=1.0, calibrated=True)
    with pytest.raises(ConfigError, match=r"^Expected DPConfig\.target_epsilon=0\.0 to be finite"):
        DPConfig(**_DP, target_epsilon=0.0)
    with pytest.raises(ConfigError, match=r"^Expected DPConfig\.accountant='gdp' to be one of"):
        DPConfig(**_DP, noise_multiplier=1.0, accountant="gdp")
    asked = DPConfig(**_DP, target_epsilon=3.0)
    with pytest.raises(ConfigError, match=r"target_epsilon=3\.0 is not calibrated yet"):
        _ = asked.sigma
    # a calibrated config carries both, and its record reads back as one
    done = dataclasses.replace(asked, noise_multiplier=1.25, calibrated=True)
    assert done.sigma == 1.25 and done.is_calibrated
    assert DPConfig.from_record(done.to_record()) == done
    assert DPConfig.from_record(asked.to_record()) == asked
    for line in (str(e) for e in _errors()):
        assert "\n" not in line


def _errors() -> list[ConfigError]:
    out = []
    kws: list[dict[str, Any]] = [{}, {"noise_multiplier": 1.0, "target_epsilon": 3.0}]
    for kw in kws:
        try:
            DPConfig(**_DP, **kw)
        except ConfigError as exc:
            out.append(exc)
    return out


@pytest.mark.parametrize("method", ["pld", "rdp"])
def test_calibrated_sigma_reaches_the_target(method: str) -> None:
    dp = te.calibrate(DPConfig(**_DP, target_epsilon=TARGET, accountant=method))
    spent = epsilon(dp.sigma, 512, 16, 12, 4, 1e-5, method)
    assert spent <= TARGET
    # the smallest such sigma, to the calibration's 0.1% steps (and its 1e-5 search)
    assert epsilon(dp.sigma / 1.002, 512, 16, 12, 4, 1e-5, method) > TARGET
    assert dp.target_epsilon == TARGET and dp.accountant == method


def test_target_recorded_and_reused_on_resume(tmp_path: Path, calibrations: list[float]) -> None:
    url = str(tmp_path / "s.zarr")
    cfg = _job()
    first = te.calibrated_job(cfg, url)
    assert calibrations == [TARGET]
    assert first.dp.target_epsilon == TARGET and first.dp.noise_multiplier is not None
    assert run_job(first, url, stop_after=8).steps_done == 8
    assert calibrations == [TARGET]  # the job's start never recalibrates a calibrated config
    stored = Store.open(url, create=False).latest()
    assert stored is not None
    dp = stored.records["config"]["dp"]
    assert dp["target_epsilon"] == TARGET and dp["noise_multiplier"] == first.dp.sigma
    assert stored.records["accountant"]["noise_multiplier"] == first.dp.sigma
    # the same command again: the stored sigma, no calibration, an accepted resume
    again = te.calibrated_job(cfg, url)
    assert again == first and calibrations == [TARGET]
    result = run_job(again, url)
    assert result.resumed_from == 8 and result.steps_done == 12
    assert result.epsilon <= TARGET and calibrations == [TARGET]


def test_a_resume_with_another_target_is_refused(tmp_path: Path, calibrations: list[float]) -> None:
    url = str(tmp_path / "s.zarr")
    first = te.calibrated_job(_job(), url)
    run_job(first, url, stop_after=4)
    versions = Store.open(url, create=False).versions()
    with pytest.raises(ConfigMismatchError) as info:
        te.calibrated_job(_job(target_epsilon=2 * TARGET), url)
    assert info.value.differences == [f"dp.target_epsilon: stored {TARGET!r}, now {2 * TARGET!r}"]
    with pytest.raises(ConfigMismatchError, match="dp.accountant: stored 'pld', now 'rdp'"):
        te.calibrated_job(_job(accountant="rdp"), url)
    assert calibrations == [TARGET]  # a refused resume calibrates nothing
    # the calibrated sigma given as a plain sigma is another job: it names no target
    plain = dataclasses.replace(first, dp=DPConfig(**_DP, noise_multiplier=first.dp.sigma))
    with pytest.raises(ConfigMismatchError, match=r"dp\.target_epsilon: stored 4\.0, now None"):
        run_job(plain, url)
    assert Store.open(url, create=False).versions() == versions


def test_a_record_whose_sigma_misses_its_target_is_refused(tmp_path: Path) -> None:
    loose = DPConfig(**_DP, noise_multiplier=0.5, target_epsilon=1.0, calibrated=True)
    with pytest.raises(ConfigError, match=r"noise_multiplier=0\.5 gives epsilon=.* above"):
        te.calibrated_job(JobConfig(job="example:mlp", dp=loose), str(tmp_path / "s.zarr"))
    assert not (tmp_path / "s.zarr").exists()


def test_the_accountant_is_fingerprinted_only_with_a_target() -> None:
    shapes = {"w": [2, 2]}
    plain = JobConfig(job="example:mlp", dp=DPConfig(**_DP, noise_multiplier=1.0)).to_record()
    rdp_view = {**plain, "dp": {**plain["dp"], "accountant": "rdp"}}
    old = {
        **plain,
        "dp": {k: v for k, v in plain["dp"].items() if k not in ("target_epsilon", "accountant")},
    }
    # the reported epsilon's method is a view; stores written before these fields keep theirs
    assert fingerprint(rdp_view, shapes) == fingerprint(plain, shapes) == fingerprint(old, shapes)
    calibrated = DPConfig(**_DP, noise_multiplier=1.0, target_epsilon=TARGET, calibrated=True)
    rec = JobConfig(job="example:mlp", dp=calibrated).to_record()
    other = {**rec, "dp": {**rec["dp"], "accountant": "rdp"}}
    assert fingerprint(rec, shapes) != fingerprint(plain, shapes)
    assert fingerprint(other, shapes) != fingerprint(rec, shapes)


def test_an_accountant_restores_another_methods_steps() -> None:
    kw: dict[str, Any] = {"noise_multiplier": 1.0, "dataset_size": 512, "batch_size": 16}
    acc = Accountant(**kw, bands=4, delta=1e-5)
    acc.step(9)
    view = Accountant(**kw, bands=4, delta=1e-5, method="rdp")
    view.load_state_dict(acc.state_dict(with_epsilon=False))
    assert view.steps == 9 and view.epsilon() == epsilon(1.0, 512, 16, 9, 4, 1e-5, "rdp")


@pytest.mark.parametrize("method", ["pld", "rdp"])
@pytest.mark.parametrize("delta", [1e-7, 1e-3])
def test_epsilon_at_another_delta_is_direct_composition(delta: float, method: str) -> None:
    acc = Accountant(noise_multiplier=0.9, dataset_size=512, batch_size=16, bands=4, delta=1e-5)
    acc.step(11)
    event = acc.state_dict(with_epsilon=False)["event"]
    want = _direct(0.9, 16 * 4 / 512, math.ceil(11 / 4), delta, method)
    assert epsilon_of_event(event, delta, method) == want


def test_a_malformed_event_is_named() -> None:
    with pytest.raises(ValueError, match="LaplaceDpEvent"):
        epsilon_of_event({"type": "LaplaceDpEvent"}, 1e-5)
    bad = {"type": "SelfComposedDpEvent", "count": -1, "event": {}}
    with pytest.raises(ValueError, match="count=-1"):
        epsilon_of_event(bad, 1e-5)
    with pytest.raises(ValueError, match="delta=1.0"):
        epsilon_of_event(bad, 1.0)


def test_the_privacy_report_shows_the_target_and_the_calibrated_sigma() -> None:
    dp = DPConfig(**_DP, noise_multiplier=1.5, target_epsilon=TARGET, calibrated=True)
    rec = {"config": JobConfig(job="example:mlp", dp=dp).to_record()}
    g = describe(rec, steps_done=4, epsilon=1.0, accounting_method="pld")
    assert g["target_epsilon"] == TARGET and g["noise_multiplier"] == 1.5
    assert "calibrated once" in g["noise_multiplier_means"]
    assert "target_epsilon=4" in g["noise_multiplier_means"]
    given = {
        "config": JobConfig(job="example:mlp", dp=DPConfig(**_DP, noise_multiplier=1.5)).to_record()
    }
    g = describe(given, steps_done=4, epsilon=1.0, accounting_method="pld")
    assert g["target_epsilon"] is None and "given" in g["noise_multiplier_means"]
