"""A BLT job end to end: it trains, its noise is the dense C^-1 z, stop and resume is
bit-identical, the audit regenerates its buffers, its epsilon is the BLT accounting's,
and a resume refuses a stored BLT that its records contradict."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from cocoon_ckpt import ConfigMismatchError, DPConfig, JobConfig, run_job
from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity, blt_epsilon
from cocoon_ckpt.dp.blt.optimize import job_blt, rational_approx_blt
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.dp.plan import plan
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.target_epsilon import calibrate
from cocoon_ckpt.train.trainer import DPTrainer
from fault_injection import CrashPointHit, crash_at, disarm_all
from state import Store

from .conftest import reseal

STEPS, BANDS = 12, 2
KEY = bytes(range(32))


def _config(**kw: object) -> JobConfig:
    dp = DPConfig(
        steps=STEPS,
        batch_size=16,
        dataset_size=512,
        noise_multiplier=1.0,
        bands=BANDS,
        mechanism=MechanismKind.BLT,
    )
    return JobConfig(job="example:mlp", dp=dp, checkpoint_every=5, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One uninterrupted BLT job (the key in a file, shared by the resumed runs)."""
    root = tmp_path_factory.mktemp("blt")
    key = str(root / "k")
    run_job(_config(), str(root / "gold.zarr"), options=JobOptions(key_file=key))
    return root / "gold.zarr", key


def _model_arrays(url: Path) -> dict[str, np.ndarray]:
    latest = Store.open(str(url), create=False).latest()
    assert latest is not None
    return {n: latest.array(n).copy() for n in latest.manifest.arrays if n.startswith("model/")}


def test_stop_and_resume_is_bit_identical(gold: tuple[Path, str], tmp_path: Path) -> None:
    root, key = gold
    url = str(tmp_path / "run.zarr")
    for stop in (3, 7):  # between checkpoints: the work since the last one is redone
        run_job(_config(), url, stop_after=stop, options=JobOptions(key_file=key))
    fitted = job_blt(STEPS, BANDS)
    job_blt.cache_clear()
    try:
        res = run_job(_config(), url, options=JobOptions(key_file=key))
        assert job_blt.cache_info().misses == 0  # the stored BLT ran: nothing was fitted
    finally:
        job_blt.cache_clear()
    assert res.resumed_from == 5 and res.steps_done == STEPS
    assert job_blt(STEPS, BANDS).state_dict() == fitted.state_dict()  # deterministic fit
    want, got = _model_arrays(root), _model_arrays(Path(url))
    assert want.keys() == got.keys()
    assert all(np.array_equal(want[k], got[k]) for k in want)
    latest = Store.open(url, create=False).latest()
    gold_latest = Store.open(str(root), create=False).latest()
    assert latest is not None and gold_latest is not None
    assert latest.records["mechanism"] == gold_latest.records["mechanism"]
    assert latest.records["accountant"] == gold_latest.records["accountant"]
    for shard, g in zip(
        latest.records["noise"]["shards"], gold_latest.records["noise"]["shards"], strict=True
    ):
        a = [latest.array(s[2])[s[3]] for s in shard["slots"]]
        b = [gold_latest.array(s[2])[s[3]] for s in g["slots"]]
        assert all((x == y).all() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("point", ["noise.after_gemv", "trainer.after_update"])
def test_a_crash_mid_step_resumes_bit_identical(
    gold: tuple[Path, str], tmp_path: Path, point: str
) -> None:
    """Crash between the GEMV and the buffers' update (or after the update), then
    resume: the buffers come from the last version, never from the torn memory."""
    root, key = gold
    url = str(tmp_path / "crash.zarr")
    crash_at(point, step=8)
    try:
        with pytest.raises(CrashPointHit):
            run_job(_config(async_checkpoint=False), url, options=JobOptions(key_file=key))
    finally:
        disarm_all()
    assert run_job(_config(), url, options=JobOptions(key_file=key)).resumed_from == 5
    want, got = _model_arrays(root), _model_arrays(Path(url))
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_a_resume_on_the_far_tier_is_bit_identical(gold: tuple[Path, str], tmp_path: Path) -> None:
    """The buffers are a RingHistory like BandMF's ring: the tiers hold them, and the
    noise does not depend on where they lie."""
    root, key = gold
    url = str(tmp_path / "far.zarr")
    run_job(_config(), url, stop_after=7, options=JobOptions(key_file=key))
    far = TierConfig(
        device_bytes=1 << 26, host_bytes=0, far_bytes=1 << 30, counts={"device": 0, "far": 1}
    )
    assert run_job(_config(tiers=far), url, options=JobOptions(key_file=key)).resumed_from == 5
    want, got = _model_arrays(root), _model_arrays(Path(url))
    assert all(np.array_equal(want[k], got[k]) for k in want)
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    assert [p["tier"] for p in latest.records["noise"]["placement"]] == ["far"]


def test_each_version_stores_all_buffers_and_the_audit_regenerates_them(
    gold: tuple[Path, str],
) -> None:
    root, key = gold
    blt = job_blt(STEPS, BANDS)
    store = Store.open(str(root), create=False)
    for v in store.versions():
        rec = store.read(v).records
        (shard,) = rec["noise"]["shards"]
        assert [s[0] for s in shard["slots"]] == list(range(blt.buffers))
        assert {s[1] for s in shard["slots"]} == {rec["trainer"]["step"] - 1}
    report = audit_store(str(root), key_file=key, seed=3)
    noise = report.checks["noise"]
    assert noise["mechanism"] == "blt" and noise["slots"] >= blt.buffers
    assert noise["bit_identical"] == noise["slots"] and noise["max_deviation"] == 0.0
    # the accountant check recomputes epsilon from the config (tools.audit.records):
    # every other check is clean
    assert [f for f in report.findings if f.check != "accountant"] == []


def test_epsilon_is_the_blt_accounting(gold: tuple[Path, str]) -> None:
    root, _ = gold
    latest = Store.open(str(root), create=False).latest()
    assert latest is not None
    acc = latest.records["accountant"]
    sens = accounting_sensitivity(job_blt(STEPS, BANDS), STEPS, BANDS)
    assert acc["sensitivity"] == sens
    assert acc["event"] == {"type": "GaussianDpEvent", "noise_multiplier": 1.0 / sens}
    assert acc["epsilon"] == blt_epsilon(1.0, sens, 1e-5)


def test_a_changed_stored_blt_is_refused(gold: tuple[Path, str], tmp_path: Path) -> None:
    root, key = gold
    url = tmp_path / "s.zarr"
    run_job(_config(), str(url), stop_after=7, options=JobOptions(key_file=key))
    for p in sorted((url / "manifests").glob("*.json")):
        doc = json.loads(p.read_text())
        mech = doc["records"]["mechanism"]
        mech["buf_decay"] = [x * 0.99 for x in mech["buf_decay"]]
        p.write_bytes(reseal(doc, key))  # behind the MACs: the derived sensitivity
    with pytest.raises(ConfigMismatchError, match="sensitivity"):
        run_job(_config(), str(url), options=JobOptions(key_file=key))
    # the audit derives the sensitivity from the stored BLT too
    report = audit_store(str(url), key_file=key, coordinates=8, seed=0)
    found = [f.message for f in report.findings if f.check == "accountant"]
    assert any("the stored BLT's min-sep sensitivity" in m for m in found), report.text()


def _float64_job(blt_buffers: int, rng: str = "default") -> tuple[DPTrainer, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(64, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (64,))
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = DPConfig(
        steps=STEPS,
        batch_size=8,
        dataset_size=64,
        noise_multiplier=0.7,
        bands=BANDS,
        mechanism=MechanismKind.BLT,
        noise_rng=rng,
    )
    blt = rational_approx_blt(blt_buffers, STEPS)
    trainer = DPTrainer(model, opt, nn.functional.cross_entropy, (x, y), dp, KEY, mechanism=blt)
    noise = []
    for _ in range(8):
        trainer.train_step()
        assert trainer.last_noise is not None
        noise.append(trainer.last_noise.clone())
    return trainer, torch.stack(noise)


@pytest.mark.parametrize("rng", ["default", "secure"])
def test_trained_noise_is_the_dense_solve(rng: str) -> None:
    trainer, got = _float64_job(3, rng)
    want = trainer.noise.materialize(8)
    assert trainer.noise.history_bytes() == 3 * trainer.dim * 8
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(want.abs().max()))
    sens = accounting_sensitivity(trainer.mechanism, STEPS, BANDS)  # type: ignore[arg-type]
    assert trainer.epsilon() == blt_epsilon(0.7, sens, 1e-5)
    trainer.close()


def test_refusals() -> None:
    with pytest.raises(ConfigError, match="steps"):
        DPConfig(
            steps=1, batch_size=1, dataset_size=8, noise_multiplier=1.0, mechanism=MechanismKind.BLT
        )
    with pytest.raises(ConfigError, match="embedding"):
        dataclasses.replace(_config(), embedding=EmbeddingConfig())
    with pytest.raises(ConfigError, match="BLT"):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        dp = DPConfig(steps=STEPS, batch_size=4, dataset_size=16, noise_multiplier=1.0)
        DPTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.functional.cross_entropy,
            (torch.randn(16, 3), torch.randint(0, 2, (16,))),
            dp,
            KEY,
            mechanism=rational_approx_blt(2, STEPS),
        )


def test_target_epsilon_is_calibrated_under_the_blt_accounting() -> None:
    dp = DPConfig(
        steps=STEPS,
        batch_size=16,
        dataset_size=512,
        target_epsilon=8.0,
        bands=BANDS,
        mechanism=MechanismKind.BLT,
    )
    sigma = calibrate(dp).sigma
    sens = accounting_sensitivity(job_blt(STEPS, BANDS), STEPS, BANDS)
    assert blt_epsilon(sigma, sens, 1e-5) <= 8.0
    assert blt_epsilon(sigma * (1 - 1e-6), sens, 1e-5) > 8.0 or sigma == 0.3


def test_plan_weighs_blt_under_its_own_accounting() -> None:
    out = plan(
        target_epsilon=8.0,
        delta=1e-5,
        dataset_size=512,
        batch_size=16,
        steps=STEPS,
        bands=[BANDS],
        mechanisms=["optimized", "blt"],
        model_params=1000,
    )
    (row,) = [r for r in out.rows if r.mechanism is MechanismKind.BLT]
    blt = job_blt(STEPS, BANDS)
    sens = accounting_sensitivity(blt, STEPS, BANDS)
    assert blt_epsilon(row.noise_multiplier, sens, 1e-5) <= 8.0
    want = (row.noise_multiplier / sens) ** 2 * blt.minsep_loss(BANDS) / STEPS
    assert row.predicted_error == pytest.approx(want, rel=1e-12)
    assert row.state_bytes_per_param == 4 * blt.buffers
    assert row.state_bytes == 4 * blt.buffers * 1000


def test_a_forged_buffer_label_is_out_of_bounds(gold: tuple[Path, str], tmp_path: Path) -> None:
    root, key = gold
    url = tmp_path / "forged.zarr"
    shutil.copytree(root, url, symlinks=True)
    newest = max((url / "manifests").glob("*.json"))
    doc = json.loads(newest.read_text())
    slot = doc["records"]["noise"]["shards"][0]["slots"][0]
    slot[1] -= 1  # the buffers of a version are those after its last step, never older
    newest.write_bytes(reseal(doc, key))
    report = audit_store(str(url), key_file=key, seed=3)
    assert any("BLT buffer" in f.message and "labelled step" in f.message for f in report.findings)
