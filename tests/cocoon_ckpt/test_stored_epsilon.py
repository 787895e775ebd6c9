"""Only a job's last version stores its epsilon; readers compose the others' from the
config, and every reader shows the same number a stored one would be."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cocoon_ckpt import run_job
from cocoon_ckpt._cli.catalog import _inspect_lines
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.dp.accounting.accountant import Accountant
from cocoon_ckpt.dp.accounting.amplified import epsilon_of_run
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.catalog import inspect_store
from cocoon_ckpt.tools.export import export_model
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .conftest import job_config, reseal


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 16-step job stopped at step 10 (versions at 5 and 10), and its key file."""
    root = tmp_path_factory.mktemp("eps")
    url, key = root / "s.zarr", str(root / "k")
    run_job(
        job_config("mlp", bands=4, steps=16, keep_last=5),
        str(url),
        stop_after=10,
        options=JobOptions(key_file=key),
    )
    return url, key


@pytest.fixture(scope="module")
def finished(stopped: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stopped job resumed to its end (step 16), in a copy of its store."""
    url, key = stopped
    done = tmp_path_factory.mktemp("eps-done") / "done.zarr"
    shutil.copytree(url, done, symlinks=True)
    run_job(
        job_config("mlp", bands=4, steps=16, keep_last=5),
        str(done),
        options=JobOptions(key_file=key),
    )
    return done


def _accountant(url: Path, version: int) -> dict[str, object]:
    return Store.open(str(url)).manifest(version).records["accountant"]  # type: ignore[no-any-return]


def test_mid_run_versions_store_the_event_and_the_last_its_epsilon(
    stopped: tuple[Path, str], finished: Path
) -> None:
    url, key = stopped
    store = Store.open(str(url))
    assert [store.manifest(v).step for v in store.versions()] == [5, 10]
    for v in store.versions():
        acc = _accountant(url, v)
        assert acc["epsilon"] is None
        assert acc["event"]["count"] == -(-store.manifest(v).step // 4)  # type: ignore[index]
    done = finished
    last = Store.open(str(done))
    acc = _accountant(done, last.versions()[-1])
    assert last.manifest(last.versions()[-1]).step == 16
    assert acc["epsilon"] == Accountant.from_state_dict(dict(acc)).epsilon() > 0


def test_inspect_composes_a_mid_run_epsilon_as_audit_recomputes_it(
    stopped: tuple[Path, str],
) -> None:
    url, key = stopped
    out = inspect_store(str(url))
    cfg = Store.open(str(url)).manifest(2).records["config"]
    for v in out["versions"]:
        assert v["epsilon_stored"] is False
        assert v["epsilon"] == epsilon_of_run(cfg["dp"], None, v["step"]) > 0
    assert out["job"]["guarantee"]["epsilon"] == out["versions"][-1]["epsilon"]
    lines = _inspect_lines(out)
    assert any(f"{out['versions'][-1]['epsilon']:.4f}*" in line for line in lines)
    assert any(line.startswith("* composed now") for line in lines)
    report = audit_store(str(url), coordinates=8, seed=0, key_file=key)
    assert report.ok, report.text()


def test_export_of_a_mid_run_version_reports_the_composed_epsilon(
    stopped: tuple[Path, str], tmp_path: Path
) -> None:
    url, key = stopped
    report = export_model(str(url), str(tmp_path / "m.pt"), allow_incomplete=True)
    assert report["epsilon"] == inspect_store(str(url))["versions"][-1]["epsilon"]


def test_a_last_version_without_its_epsilon_is_an_audit_finding(
    stopped: tuple[Path, str], finished: Path, tmp_path: Path
) -> None:
    key = stopped[1]
    done = tmp_path / "done.zarr"
    shutil.copytree(finished, done, symlinks=True)
    p = sorted((done / "manifests").glob("*.json"))[-1]
    doc = json.loads(p.read_text())
    doc["records"]["accountant"]["epsilon"] = None
    p.write_bytes(reseal(doc, key))  # a writer who recomputes checksums and MACs
    report = audit_store(str(done), coordinates=8, seed=0, key_file=key)
    found = [f.message for f in report.findings if f.check == "accountant"]
    assert found and "last step 16 stores no epsilon" in found[0]
    assert main(["inspect", str(done), "--json"]) == 0
