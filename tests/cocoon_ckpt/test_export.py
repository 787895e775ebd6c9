"""export: finished is derived, the output never lands in the store, model and report
appear together or not at all, and the report says what the guarantee is about."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt import epsilon
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.catalog import inspect_store
from cocoon_ckpt.tools.export import ExportPathError, export_model
from state import CorruptVersionError, StoreError

from .conftest import tree
from .test_audit import _edit_manifests, _manifests, clean_store  # noqa: F401


@pytest.fixture
def store(clean_store: Path, tmp_path: Path) -> Path:  # noqa: F811
    """A copy of the finished 16-step, b = 4 job that test_audit trains once a session."""
    dst = tmp_path / "s.zarr"
    shutil.copytree(clean_store, dst, symlinks=True)
    return dst


def _unfinished_flagged_complete(store: Path, threat_model: str | None = None) -> None:
    """Drop the newest version (step 16 of 16): the newest is then at step 15; stamp
    `complete: true` on it (and a threat model) as a forger who re-stamps checksums."""
    _manifests(store)[-1].unlink()
    newest = json.loads(_manifests(store)[-1].read_text())["version"]

    def flag(doc: dict[str, Any]) -> None:
        doc["records"]["complete"] = True
        if threat_model is not None:
            doc["records"]["threat_model"] = threat_model

    _edit_manifests(store, flag, only=newest)


def test_complete_flag_is_not_trusted(store: Path, tmp_path: Path) -> None:
    _unfinished_flagged_complete(store)
    out = tmp_path / "out"
    out.mkdir()
    before, out_before = tree(store), tree(out)
    with pytest.raises(StoreError, match="at step 15 of 16"):
        export_model(str(store), str(out / "m.pt"))
    # inspect derives it too; audit reports the flag that disagrees (exit 1)
    assert not inspect_store(str(store))["versions"][-1]["complete"]
    assert main(["audit", str(store), "--coordinates", "8", "--seed", "0", "--json"]) == 1
    report = audit_store(str(store), coordinates=8, seed=0)
    (found,) = [f for f in report.findings if f.check == "complete"]
    assert "complete=True" in found.message and "step 15 of 16" in found.message
    assert tree(store) == before and tree(out) == out_before


def test_unfinished_final_model_is_refused_whatever_its_flag(store: Path, tmp_path: Path) -> None:
    _unfinished_flagged_complete(store, threat_model="final_model")
    with pytest.raises(StoreError, match="final_model.*must not be released"):
        export_model(str(store), str(tmp_path / "m.pt"), allow_incomplete=True)
    assert not list(tmp_path.glob("m.pt*"))


def test_out_inside_the_store_is_refused(store: Path, tmp_path: Path) -> None:
    before = tree(store)
    link = tmp_path / "innocent.pt"
    link.symlink_to(store / "secret" / "noise.key")
    for out in (store / "secret" / "noise.key", store / "model.pt", link):
        with pytest.raises(ExportPathError, match="inside the store"):
            export_model(str(store), str(out))
        assert tree(store) == before
    # the CLI: one line, exit 2, the key untouched
    assert main(["export", str(store), "--out", str(store / "secret" / "noise.key")]) == 2
    assert tree(store) == before


def test_out_in_a_missing_folder_or_over_a_file_is_refused(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no" / "such" / "m.pt"
    assert main(["export", str(store), "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "mkdir -p" in err
    assert not (tmp_path / "no").exists()
    old = tmp_path / "old.pt.privacy.json"
    old.write_text("{}")
    with pytest.raises(ExportPathError, match="already exists"):
        export_model(str(store), str(tmp_path / "old.pt"))
    assert old.read_text() == "{}" and not (tmp_path / "old.pt").exists()


@pytest.mark.parametrize("fail", ["model_link", "save"])
def test_model_and_report_are_both_or_neither(
    store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if fail == "save":

        def broken_save(*a: Any, **k: Any) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(torch, "save", broken_save)
    else:
        real_link = os.link

        def link(src: str, dst: str) -> None:
            if not dst.endswith(".privacy.json"):  # the report lands, the model fails
                raise OSError(5, "Input/output error")
            real_link(src, dst)

        monkeypatch.setattr(os, "link", link)
    with pytest.raises(OSError):
        export_model(str(store), str(out / "m.pt"))
    assert list(out.iterdir()) == []  # neither file, no temp left
    monkeypatch.undo()
    export_model(str(store), str(out / "m.pt"))
    assert sorted(p.name for p in out.iterdir()) == ["m.pt", "m.pt.privacy.json"]


def test_tampered_epsilon_is_not_exported(store: Path, tmp_path: Path) -> None:
    def lower(doc: dict[str, Any]) -> None:
        doc["records"]["accountant"]["epsilon"] *= 0.5

    _edit_manifests(store, lower, only=json.loads(_manifests(store)[-1].read_text())["version"])
    with pytest.raises(CorruptVersionError, match="stored epsilon"):
        export_model(str(store), str(tmp_path / "m.pt"))
    assert not list(tmp_path.glob("m.pt*"))


def test_privacy_report_says_what_the_guarantee_is_about(store: Path, tmp_path: Path) -> None:
    report = export_model(str(store), str(tmp_path / "m.pt"))
    assert json.loads((tmp_path / "m.pt.privacy.json").read_text()) == json.loads(
        json.dumps(report)
    )
    assert set(torch.load(tmp_path / "m.pt")) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    eps = epsilon(1.0, 512, 16, 16, 4, 1e-5)
    want = {
        "neighbouring_relation": "zero-out",
        "dataset_size": 512,
        "expected_batch_size": 16,
        "sampling_rate": 16 * 4 / 512,
        "epsilon": eps,
        "delta": 1e-5,
        "accounting_method": "pld",
        "steps": 16,
        "steps_planned": 16,
        "complete": True,
        "bands": 4,
        "threat_model": "intermediate_iterates",
    }
    assert {k: report[k] for k in want} == want
    assert "adding or removing" in report["neighbouring_relation_means"]
    assert report["sampler"]["kind"] == "cyclic_poisson" and report["sampler"]["partitions"] == 4
    assert report["optimizer"]["name"] == "sgd" and report["optimizer"]["lr"] == 0.1
    assert report["optimizer"]["param_groups"][0]["momentum"] == 0
    # audit and inspect say the same
    audited = audit_store(str(store), coordinates=8, seed=0).info["privacy"]
    assert {k: audited[k] for k in want} == want
    inspected = inspect_store(str(store))["job"]["guarantee"]
    assert {k: inspected[k] for k in want} == want
