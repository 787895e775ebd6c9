"""Records forged by a writer of the store who lacks the job's key (#29's attacks, each
as described, the unkeyed checksums re-stamped): a resume, the audit and export refuse
them by name with the key at hand, nothing is written by a refused resume, and a store
written before format 4 resumes once allowed and bit-identically."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fault_injection.forgery import forge_manifest
from state import Store
from state.paths import manifest_path

from .conftest import reseal, tree

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["train", "--steps", "12", "--checkpoint-every", "4", "--target-epsilon", "4", "--quiet"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def _model_checksums(store: Path, version: int) -> dict[str, str]:
    doc = json.loads((store / manifest_path(version)).read_bytes())
    return {k: v["checksum"] for k, v in doc["arrays"].items() if k.startswith("model/")}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target-epsilon job run to its end: versions at steps 4, 8 and 12."""
    folder = tmp_path_factory.mktemp("forged")
    key = folder / "noise.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    done = _cli(*TRAIN, "--store", str(folder / "s.zarr"), "--key-file", str(key))
    assert done.returncode == 0, done.stderr
    return folder / "s.zarr", key


@pytest.fixture
def crashed(finished: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """The same job as if it had died after version 2 (step 8)."""
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    (store / manifest_path(3)).unlink()
    return store, finished[1]


def _forge(store: Path, version: int, keep_macs: bool, edit: Any) -> None:
    forge_manifest(Store.open(str(store), create=False), version, edit, keep_macs=keep_macs)


def _halve_sigma(doc: dict[str, Any]) -> str:
    doc["records"]["config"]["dp"]["noise_multiplier"] /= 2
    return "sigma halved"


@pytest.mark.parametrize("keep_macs", [True, False], ids=["macs-kept", "macs-stripped"])
def test_a_halved_sigma_is_refused_on_resume(crashed: tuple[Path, Path], keep_macs: bool) -> None:
    # The start reads the key before any version, so the edit is refused as a forgery
    # before the target check could read the edited sigma (the check behind the MACs
    # has its own test below).
    store, key = crashed
    _forge(store, 2, keep_macs, _halve_sigma)
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "version 2 of" in line
    if keep_macs:
        assert "record 'config'" in line and "(forged)" in line
    else:  # version 1 is sealed: version 2's MACs were certainly stripped
        assert "carries no MAC" in line
    assert "noise_multiplier" not in line
    assert tree(store) == before


def test_a_halved_sigma_resealed_by_the_keys_holder_misses_the_target(
    crashed: tuple[Path, Path],
) -> None:
    # Behind the MACs: a sigma the key's holder (or a bug) stored that does not meet
    # the job's target epsilon is refused by the target check, by its numbers.
    store, key = crashed
    path = store / manifest_path(2)
    doc = json.loads(path.read_bytes())
    _halve_sigma(doc)
    path.write_bytes(reseal(doc, key))
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "the stored noise_multiplier=" in line and "version 2" in line
    assert "does not meet the job's target_epsilon=4.0 (it gives epsilon=" in line
    assert tree(store) == before


def _double_accountant_steps(doc: dict[str, Any]) -> str:
    doc["records"]["accountant"]["steps"] *= 2
    return "accountant steps doubled"


@pytest.mark.parametrize("keep_macs", [True, False], ids=["macs-kept", "macs-stripped"])
def test_edited_accountant_steps_are_refused_on_resume(
    crashed: tuple[Path, Path], keep_macs: bool
) -> None:
    store, key = crashed
    _forge(store, 2, keep_macs, _double_accountant_steps)
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    if keep_macs:
        assert "version 2 of" in line and "record 'accountant'" in line
        assert "fails its MAC under the job's key" in line
    else:  # version 1 is sealed: version 2's MACs were certainly stripped
        assert "carries no MAC" in line and "MACs were stripped; it is refused" in line
    assert tree(store) == before


def test_a_store_written_before_format_4_resumes_once_allowed_bit_identically(
    finished: tuple[Path, Path], crashed: tuple[Path, Path]
) -> None:
    store, key = crashed
    for v in (1, 2):  # as cocoon-ckpt wrote them before format 4: no MACs
        _forge(store, v, False, lambda doc: "unchanged")
    refused = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert refused.returncode == 1 and "carries no MAC" in refused.stderr
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key), "--allow-unauthenticated")
    assert run.returncode == 0, run.stderr
    resumed = Store.open(str(store), create=False)
    newest = resumed.latest()
    assert newest is not None and (newest.version, newest.step) == (3, 12)
    assert newest.manifest.sealed
    assert _model_checksums(store, 3) == _model_checksums(finished[0], 3)


def test_audit_names_a_sigma_forged_in_every_version(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    for v in (1, 2, 3):
        _forge(store, v, True, _halve_sigma)
    run = _cli("audit", str(store), "--key-file", str(finished[1]))
    assert run.returncode == 1, run.stdout + run.stderr
    for v in (1, 2, 3):
        assert f"FINDING [authentication] (version {v}): version {v} of" in run.stdout
    assert "record 'config'" in run.stdout


def test_export_refuses_a_forged_step_with_the_key_and_says_so_without_it(
    crashed: tuple[Path, Path], tmp_path: Path
) -> None:
    store, key = crashed

    def finish(doc: dict[str, Any]) -> str:
        doc["step"] = 12
        return "step 8 -> 12"

    _forge(store, 2, True, finish)
    out = tmp_path / "model.pt"
    refused = _cli("export", str(store), "--out", str(out), "--key-file", str(key))
    assert refused.returncode == 1, refused.stderr
    assert "the header of manifest manifests/00000002.json" in refused.stderr
    assert not out.exists()
    # without the key only the unkeyed checksums vouch, and the report says so
    blind = _cli("export", str(store), "--out", str(out))
    assert blind.returncode == 0, blind.stderr
    assert "not authenticated by the job's key" in blind.stderr
    report = json.loads(Path(f"{out}.privacy.json").read_text())
    assert report["source"]["authenticated"] is False


def test_a_removed_identity_record_is_refused_not_skipped(crashed: tuple[Path, Path]) -> None:
    store, key = crashed
    path = store / manifest_path(2)
    doc = json.loads(path.read_bytes())
    del doc["records"]["identity"]
    path.write_bytes(reseal(doc, key))  # even re-sealed by the key's holder
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    assert "the identity record is missing from a sealed version" in run.stderr
    assert tree(store) == before


def _triple_sigma(doc: dict[str, Any]) -> str:
    doc["records"]["config"]["dp"]["noise_multiplier"] *= 3
    return "sigma tripled"


def test_audit_reports_the_privacy_of_the_newest_version_that_verifies(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    clean = _cli("audit", str(finished[0]), "--key-file", str(finished[1]), "--json")
    _forge(store, 3, True, _triple_sigma)
    run = _cli("audit", str(store), "--key-file", str(finished[1]), "--json")
    assert run.returncode == 1, run.stderr
    got, want = json.loads(run.stdout), json.loads(clean.stdout)
    assert [f["version"] for f in got["findings"] if f["check"] == "authentication"] == [3]
    # reported from version 2 (step 8), the newest the key vouches for, not the forgery
    assert got["info"]["privacy"]["noise_multiplier"] == want["info"]["privacy"]["noise_multiplier"]
    assert got["info"]["privacy"]["steps"] == 8


def test_a_stripped_version_above_a_sealed_one_is_refused_even_when_allowed(
    crashed: tuple[Path, Path],
) -> None:
    store, key = crashed
    _forge(store, 2, False, lambda doc: "MACs stripped")  # version 1 stays sealed
    before = tree(store)
    for extra in ((), ("--allow-unauthenticated",)):
        run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key), *extra)
        assert run.returncode == 1, (extra, run.stderr)
        assert "MACs were stripped" in run.stderr, (extra, run.stderr)
        assert "--allow-unauthenticated (" not in run.stderr
        assert tree(store) == before


def test_a_forged_key_id_is_a_forgery_not_a_wrong_key(crashed: tuple[Path, Path]) -> None:
    store, key = crashed

    def other_id(doc: dict[str, Any]) -> str:
        doc["records"]["key_id"] = "0" * 16
        return "key_id replaced"

    _forge(store, 2, True, other_id)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    assert "record 'key_id'" in run.stderr and "fails its MAC" in run.stderr
    assert "another job's key" not in run.stderr


def test_a_key_planted_in_the_store_does_not_authenticate_an_export(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    store = tmp_path / "s.zarr"
    shutil.copytree(finished[0], store)
    planted = os.urandom(32)
    (store / "secret").mkdir(mode=0o700)
    (store / "secret" / "noise.key").write_bytes(planted)
    (store / "secret" / "noise.key").chmod(0o600)
    (tmp_path / "planted").write_bytes(planted)
    for v in (1, 2, 3):  # every version re-sealed under the planted key
        path = store / manifest_path(v)
        path.write_bytes(reseal(json.loads(path.read_bytes()), tmp_path / "planted"))
    out = tmp_path / "m.pt"
    run = _cli("export", str(store), "--out", str(out), "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["source"]["authenticated"] is False
    # with the job's own key file, every version is refused and the key is not blamed
    refused = _cli(
        "export", str(store), "--out", str(tmp_path / "n.pt"), "--key-file", str(finished[1])
    )
    assert refused.returncode == 1, refused.stderr
    assert "fails its MAC" in refused.stderr


def test_an_old_stores_edited_accountant_steps_are_derived_not_trusted(
    crashed: tuple[Path, Path],
) -> None:
    store, key = crashed
    _forge(store, 1, False, lambda doc: "as written before format 4")
    _forge(store, 2, False, _double_accountant_steps)
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key), "--allow-unauthenticated")
    assert run.returncode == 1, run.stderr
    assert "accountant.steps=16, the version is at step 8" in run.stderr
    assert tree(store) == before


def test_a_stored_state_the_job_cannot_take_is_the_stores_fault(crashed: tuple[Path, Path]) -> None:
    """A sampler record edited by the key's holder (so its MACs verify) exits 1, a
    version refused, not 2, a malformed request."""
    store, key = crashed
    path = store / manifest_path(2)
    doc = json.loads(path.read_bytes())
    doc["records"]["sampler"]["seed"] = "x"
    path.write_bytes(reseal(doc, key))
    before = tree(store)
    run = _cli(*TRAIN, "--store", str(store), "--key-file", str(key))
    assert run.returncode == 1, run.stderr
    assert "version 2 of" in run.stderr and "sampler state" in run.stderr
    assert tree(store) == before
