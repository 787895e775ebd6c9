"""Metrics stored with the versions (`format.metrics`): every step's loss equals the
uninterrupted run's StepResult losses, a crash then a resume stores each step exactly
once, the loop's scalars round-trip, refusals name what was wrong, `inspect` shows the
curves and the audit finds a tampered metrics record."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import struct
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from cocoon_ckpt import StepResult, open_job, run_job
from cocoon_ckpt._cli.catalog import _inspect_lines
from cocoon_ckpt.examples import mlp as mlp_job
from cocoon_ckpt.format.metrics import (
    MetricsError,
    Series,
    TrainingMetrics,
    pack_values,
    read_metrics,
)
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.catalog import inspect_store
from cocoon_ckpt.train.options import JobOptions
from fault_injection import CrashPointHit, crash_at, disarm_all
from state import Store

from .conftest import job_config, reseal

CFG = job_config("mlp", bands=4, steps=24, keep_last=3)


def _curve(url: str) -> dict[str, Series]:
    latest = Store.open(url, create=False).latest()
    assert latest is not None
    return read_metrics(latest.records["metrics"], latest.step, url)


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[StepResult]]:
    """An uninterrupted run (its key in `k` beside it) and the result of each step."""
    root = tmp_path_factory.mktemp("metrics")
    results: list[StepResult] = []
    key = str(root / "k")
    run_job(
        CFG,
        str(root / "gold.zarr"),
        on_step=lambda r, _t: results.append(r),
        options=JobOptions(key_file=key),
    )
    return root / "gold.zarr", results


def test_every_steps_loss_is_stored_as_the_step_returned_it(
    gold: tuple[Path, list[StepResult]],
) -> None:
    url, results = gold
    loss = _curve(str(url))["loss"]
    want = [(r.step, r.loss) for r in results if math.isfinite(r.loss)]
    assert list(zip(loss.steps, loss.values, strict=True)) == want
    assert loss.steps == list(range(24))  # no empty batch in this job: every step
    for name in ("grad_norm", "noise_norm"):  # signal and noise, as each step returned them
        got = _curve(str(url))[name]
        assert got.steps == list(range(24))
        assert got.values == [getattr(r, name) for r in results]
        assert all(v > 0 for v in got.values)
    # retention kept 3 of the 5 versions; the newest still holds the curve from step 0
    store = Store.open(str(url), create=False)
    assert len(store.versions()) == 3
    for v in store.versions():
        m = store.manifest(v)
        part = read_metrics(m.records["metrics"], m.step, str(v))["loss"]
        assert part.steps == list(range(m.step))


def test_a_crash_then_resume_stores_each_step_once(
    gold: tuple[Path, list[StepResult]], tmp_path: Path
) -> None:
    url, key = str(tmp_path / "run.zarr"), str(gold[0].parent / "k")
    cfg = dataclasses.replace(CFG, async_checkpoint=False)
    crash_at("trainer.after_update", step=13)  # after the version of step 10
    try:
        with pytest.raises(CrashPointHit):
            run_job(cfg, url, options=JobOptions(key_file=key))
    finally:
        disarm_all()
    assert _curve(url)["loss"].steps == list(range(10))
    run_job(
        cfg, url, stop_after=17, options=JobOptions(key_file=key)
    )  # steps 10..16 again, 15 checkpointed
    res = run_job(cfg, url, options=JobOptions(key_file=key))
    assert res.resumed_from == 15
    got, want = _curve(url)["loss"], _curve(str(gold[0]))["loss"]
    assert got.steps == list(range(24)) and got == want


def test_the_loops_scalars_round_trip_through_a_resume(tmp_path: Path) -> None:
    url, key = str(tmp_path / "own.zarr"), str(tmp_path / "k")
    with open_job(CFG, url, mlp_job.build(CFG), options=JobOptions(key_file=key)) as job:
        for res in job.steps(until=7):
            job.log(lr=0.1 * res.step)
            if res.step % 3 == 2:
                job.log(res.step, accuracy=res.step / 100, top5=1)
    with open_job(CFG, url, mlp_job.build(CFG), options=JobOptions(key_file=key)) as job:
        assert job.metrics.series("lr").steps == list(range(7))
        for res in job.steps():
            job.log(lr=0.1 * res.step)
            if res.step % 3 == 2:
                job.log(res.step, accuracy=res.step / 100, top5=1)
    curve = _curve(url)
    # each step's loss and its signal/noise norms come with every step (StepResult)
    assert set(curve) == {"accuracy", "grad_norm", "loss", "lr", "noise_norm", "top5"}
    assert curve["lr"].steps == list(range(24))
    assert curve["lr"].values == [0.1 * t for t in range(24)]  # floats exactly
    assert curve["accuracy"].steps == list(range(2, 24, 3))
    assert curve["accuracy"].values == [t / 100 for t in range(2, 24, 3)]
    assert curve["top5"].values == [1.0] * 8
    raw = Store.open(url, create=False).latest().records["metrics"]  # type: ignore[union-attr]
    assert raw["series"]["accuracy"]["steps"][:2] == [[2, 3], [5, 6]]  # runs of steps

    info = inspect_store(url)
    last = info["versions"][-1]["metrics"]
    assert last["loss"]["points"] == 24 and last["loss"]["last_step"] == 23
    assert last["accuracy"] == {"points": 8, "last_step": 23, "last": 0.23}
    text = "\n".join(_inspect_lines(info))
    assert "loss 24 points, last" in text and "accuracy 8 points, last 0.23 at step 23" in text


def test_refused_scalars_name_the_reason(tmp_path: Path) -> None:
    url, key = str(tmp_path / "r.zarr"), str(tmp_path / "k")
    cfg = job_config("mlp", bands=2, steps=12)
    with open_job(cfg, url, mlp_job.build(cfg), options=JobOptions(key_file=key)) as job:
        with pytest.raises(MetricsError, match=r"step -1 .* \[0, 0\)"):
            job.log(acc=1.0)  # no step taken yet
        steps = [res.step for res in job.steps(until=6)]
        assert steps[-1] == 5
        with pytest.raises(MetricsError, match="name '1acc' is not allowed"):
            job.log(**{"1acc": 1.0})  # type: ignore[arg-type]
        with pytest.raises(MetricsError, match="metric acc of step 5 is nan"):
            job.log(acc=float("nan"))
        with pytest.raises(MetricsError, match="'high' is not a number"):
            job.log(acc="high")  # type: ignore[arg-type]
        with pytest.raises(MetricsError, match=r"step 4 .* \[5, 6\)"):
            job.log(4, acc=1.0)  # step 4 is in the version of step 5
        with pytest.raises(MetricsError, match="loss already has a point at step 5"):
            job.log(loss=0.0, acc=1.0)
        assert job.metrics.series("acc").steps == []  # all or nothing
        job.log(acc=1.0)


def test_metrics_records_are_checked_when_read() -> None:
    ok = TrainingMetrics()
    ok.add(0, {"a": 1.0})
    ok.add(1, {"a": 2.0})
    rec: dict[str, Any] = dict(ok.to_record(2))
    assert read_metrics(rec, 2, "v")["a"] == Series([0, 1], [1.0, 2.0])
    with pytest.raises(MetricsError, match="v: metrics record stops at step 2, .* step 3"):
        read_metrics(rec, 3, "v")
    bad = json.loads(json.dumps(rec))
    bad["series"]["a"]["steps"] = [[1, 3]]
    with pytest.raises(MetricsError, match=r"run \[1, 3\] .* step 2"):
        read_metrics(bad, 2, "v")
    bad["series"]["a"] = {"steps": [[0, 2]], "values": pack_values([1.0])}
    with pytest.raises(MetricsError, match="holds 2 steps but not as many values"):
        read_metrics(bad, 2, "v")
    for garbage in ([1.0, 2.0], "not base64!", pack_values([1.0, 2.0])[:-4], 3):
        bad["series"]["a"] = {"steps": [[0, 2]], "values": garbage}
        with pytest.raises(MetricsError, match="not base64 of little-endian float64s"):
            read_metrics(bad, 2, "v")
    bad["series"]["a"] = {"steps": [[0, 2]], "values": pack_values([1.0, float("inf")])}
    with pytest.raises(MetricsError, match="the value of step 1 is inf"):
        read_metrics(bad, 2, "v")


def test_a_schema_1_record_is_still_read() -> None:
    """Stores written before schema 2 held each series' values as a JSON list."""
    old = {
        "schema_version": 1,
        "stop": 5,
        "series": {"loss": {"steps": [[0, 2], [3, 5]], "values": [0.5, 0.25, 1, 2.5]}},
    }
    assert read_metrics(old, 5, "v") == {"loss": Series([0, 1, 3, 4], [0.5, 0.25, 1.0, 2.5])}
    old["series"]["loss"]["values"] = pack_values([0.5, 0.25, 1.0, 2.5])  # type: ignore[index]
    with pytest.raises(MetricsError, match="holds 4 steps but not as many values"):
        read_metrics(old, 5, "v")
    with pytest.raises(MetricsError, match="of schema 1 or 2"):
        read_metrics({**old, "schema_version": 3}, 5, "v")


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=40))
def test_packed_values_read_back_exactly(values: list[float]) -> None:
    m = TrainingMetrics()
    for t, v in enumerate(values):
        m.add(t, {"x": v})
    rec = json.loads(json.dumps(m.to_record(len(values))))
    got = read_metrics(rec, len(values), "v").get("x", Series())
    assert [struct.pack("<d", v) for v in got.values] == [struct.pack("<d", v) for v in values]
    assert got.steps == list(range(len(values)))


def _latest_manifest(root: Path) -> Path:
    return sorted((root / "manifests").glob("*.json"))[-1]


def test_a_tampered_metrics_record_is_found_by_the_audit(
    gold: tuple[Path, list[StepResult]], tmp_path: Path
) -> None:
    store, key = tmp_path / "s.zarr", str(gold[0].parent / "k")
    shutil.copytree(gold[0], store, symlinks=True)
    clean = audit_store(str(store), coordinates=8, seed=0, key_file=key)
    assert clean.ok, clean.text()
    # 24 steps x (loss, grad_norm, noise_norm)
    assert clean.checks["metrics"] == {"versions": 3, "points": 72}
    # a loss changed in the bytes: the record's sha256 no longer holds
    p = _latest_manifest(store)
    text = p.read_text()
    doc = json.loads(text)
    loss = doc["records"]["metrics"]["series"]["loss"]
    packed = loss["values"]
    values = read_metrics(doc["records"]["metrics"], doc["step"], "v")["loss"].values
    values[3] *= 0.5
    p.write_text(text.replace(packed, pack_values(values), 1))
    report = audit_store(str(store), coordinates=8, seed=0, key_file=key)
    assert not report.ok and "metrics" in report.text()

    # the same change by a writer who recomputes the checksums: the parent disagrees
    loss["values"] = pack_values(values)
    p.write_bytes(reseal(doc, key))
    report = audit_store(str(store), coordinates=8, seed=0, key_file=key)
    found = [f.message for f in report.findings if f.check == "metrics"]
    assert found and "metric loss of the steps before" in found[0]

    # a point labelled at the version's own step
    loss["steps"] = [[0, 25]]
    loss["values"] = pack_values([*values, 1.0])
    p.write_bytes(reseal(doc, key))
    report = audit_store(str(store), coordinates=8, seed=0, key_file=key)
    found = [f.message for f in report.findings if f.check == "metrics"]
    assert found and "run [0, 25]" in found[0]
    assert inspect_store(str(store))["versions"][-1]["metrics"]["error"].startswith("version")
