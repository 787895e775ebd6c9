"""audit, inspect, diff, gc: each tampering kind is found; nothing is ever changed."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from cocoon_ckpt import NoiseKeyError, run_job
from cocoon_ckpt._cli.main import main
from cocoon_ckpt.tools.audit import audit_store
from cocoon_ckpt.tools.catalog import collect_garbage, diff_versions, inspect_store
from cocoon_ckpt.train.config import fingerprint
from cocoon_ckpt.train.options import JobOptions
from state import LeaseHeldError, Store, array_checksum

from .conftest import job_config, reseal, tree


@pytest.fixture(scope="session")
def clean_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("audit") / "s.zarr"
    run_job(job_config("mlp", bands=4, steps=16, keep_last=3), str(root))
    return root


@pytest.fixture
def store(clean_store: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "s.zarr"
    shutil.copytree(clean_store, dst, symlinks=True)
    return dst


def _manifests(root: Path) -> list[Path]:
    return sorted((root / "manifests").glob("*.json"))


def _write_manifest(p: Path, doc: dict[str, Any]) -> None:
    """Write an edited manifest as a writer who holds the store's key would (checksums
    and MACs recomputed): what the checks behind the MACs must catch. A writer without
    the key is refused by the MACs first (test_forged_records)."""
    p.write_bytes(reseal(doc, p.parent.parent))


def _edit_manifests(root: Path, edit: Any, only: int | None = None) -> None:
    """Apply `edit` to every manifest's document (or to version `only`'s), re-stamped."""
    for p in _manifests(root):
        doc = json.loads(p.read_text())
        if only is None or doc["version"] == only:
            edit(doc)
            _write_manifest(p, doc)


def _scale_with_valid_checksums(root: Path, path: str) -> None:
    """Multiply the array at store path `path` by 1.001 and re-stamp every manifest's
    checksum of it: only regenerating the noise from the key can tell."""
    arr = zarr.open_array(str(root / path), mode="r+")
    tampered = (arr[...] * np.float32(1.001)).astype(arr.dtype)
    arr[...] = tampered  # zarr rewrites the chunks with valid crc32c

    def fix(doc: dict[str, Any]) -> None:
        for meta in doc["arrays"].values():
            if meta["path"] == path:
                meta["checksum"] = array_checksum(tampered)

    _edit_manifests(root, fix)


def _findings(report: Any, check: str) -> list[str]:
    return [f.message for f in report.findings if f.check == check]


def test_clean_store_holds_and_audit_changes_nothing(store: Path, tmp_path: Path) -> None:
    before = tree(store)
    report = audit_store(str(store), coordinates=10_000, seed=3, plot_dir=str(tmp_path / "p"))
    assert report.ok, report.text()
    noise = report.checks["noise"]
    # every stored slot regenerated from the key, at every coordinate, bit for bit
    assert noise["coordinates"] == inspect_store(str(store))["job"]["dim"]
    assert noise["slots"] == noise["bit_identical"] > 0 and noise["max_deviation"] == 0.0
    assert report.checks["checksums"]["arrays"] > 0
    # 3 versions kept, only the job's last stores its epsilon (the others their event)
    assert report.checks["accountant"]["epsilons_recomputed"] == 1
    assert "owner uid" in report.info["readable_by"] and "only" in report.info["readable_by"]
    assert "intermediate_iterates" in report.info["threat_model"]
    assert "in the store" in report.info["key"]
    assert sorted(Path(p).name for p in report.plots) == [
        "checkpoint_sizes.png",
        "epsilon.png",
        "history_tiers.png",
        "noise_norm.png",
    ]
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in report.plots)
    assert tree(store) == before


def test_changed_ring_slot_with_valid_checksums_is_found(store: Path) -> None:
    m = json.loads(_manifests(store)[-1].read_text())
    name = sorted(n for n in m["arrays"] if n.startswith("ring/"))[0]
    path = m["arrays"][name]["path"]
    _scale_with_valid_checksums(store, path)
    # every checksum holds: only regenerating the noise from the key can tell
    Store.open(str(store), create=False).latest()
    report = audit_store(str(store), coordinates=64, seed=0)
    assert not report.ok
    found = _findings(report, "noise")
    assert found and all(path in f for f in found)
    assert not _findings(report, "checksums")


def test_changed_accountant_record_is_found(store: Path) -> None:
    def lower(doc: dict[str, Any]) -> None:
        if doc["version"] == max(json.loads(p.read_text())["version"] for p in _manifests(store)):
            doc["records"]["accountant"]["epsilon"] *= 0.5
            doc["records"]["accountant"]["steps"] -= 4

    _edit_manifests(store, lower)
    report = audit_store(str(store), coordinates=8, seed=0)
    found = _findings(report, "accountant")
    assert any("stored epsilon" in f for f in found)
    assert any("steps=12" in f and "16" in f for f in found)


def test_manifest_from_another_job_is_found(store: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.zarr"
    run_job(job_config("mlp", bands=4, steps=4, seed=7), str(other))
    (src,) = _manifests(other)
    doc = json.loads(src.read_text())
    nxt = int(_manifests(store)[-1].stem) + 1
    (old_folder,) = {m["path"].split("/")[1] for m in doc["arrays"].values()}
    new_folder = f"{nxt:08d}-g1"
    shutil.copytree(other / "versions" / old_folder, store / "versions" / new_folder)
    for meta in doc["arrays"].values():
        meta["path"] = meta["path"].replace(old_folder, new_folder)
    doc["version"], doc["parent"] = nxt, nxt - 1
    _write_manifest(store / "manifests" / f"{nxt:08d}.json", doc)
    assert Store.open(str(store), create=False).latest().version == nxt  # it verifies
    report = audit_store(str(store), coordinates=8, seed=0)
    assert any("different job fingerprints" in f for f in _findings(report, "fingerprint"))
    assert any(f.check == "key" and f.version == nxt for f in report.findings)


def test_world_readable_store_is_found(store: Path) -> None:
    for p in [store, *store.rglob("*")]:
        os.chmod(p, os.stat(p).st_mode | 0o005 | (0o001 if p.is_dir() else 0))
    report = audit_store(str(store), coordinates=8, seed=0)
    (found,) = _findings(report, "permissions")
    assert "read by others" in found and "chmod -R go-rwx" in found
    assert report.checks["permissions"]["exposed_to_group"] == 0
    # the root closed again: nothing inside is reachable, whatever its own mode
    os.chmod(store, 0o700)
    assert audit_store(str(store), coordinates=8, seed=0).ok


def test_key_kept_outside_needs_key_file(tmp_path: Path) -> None:
    url, key = str(tmp_path / "k.zarr"), str(tmp_path / "key")
    run_job(job_config("mlp", bands=4, steps=8), url, options=JobOptions(key_file=key))
    with pytest.raises(NoiseKeyError, match="--key-file"):
        audit_store(url)
    report = audit_store(url, key_file=key, coordinates=16)
    assert report.ok and "not in the store" in report.info["key"]
    wrong = tmp_path / "wrong"
    wrong.write_bytes(bytes(32))
    wrong.chmod(0o600)
    bad = audit_store(url, key_file=str(wrong), coordinates=16)
    assert _findings(bad, "key") and _findings(bad, "noise")


def test_inspect_diff_gc(store: Path) -> None:
    out = inspect_store(str(store))
    assert [v["step"] for v in out["versions"]] == [10, 15, 16]
    v = out["versions"][-1]
    assert v["complete"] and v["bytes_written_by_kind"]["ring"] < v["bytes_total_by_kind"]["ring"]
    assert v["placement"] == [{"start": 0, "stop": out["job"]["dim"], "tier": "host", "slots": 3}]
    one = inspect_store(str(store), version=v["version"])
    assert one["config"]["dp"]["bands"] == 4 and "model/0.weight" in one["arrays"]
    a, b = (x["version"] for x in out["versions"][-2:])
    d = diff_versions(str(store), a, b)
    assert d["same_job"] and d["records_changed"]["trainer.step"] == {"from": 15, "to": 16}
    assert "ring/shard-0000/w-00000015-00000015" in d["arrays_added"]
    assert set(d["arrays_shared"]) == {"ring/shard-0000/w-00000012-00000014"}
    Store.open(str(store), create=False).acquire_lease()  # a live writer (this process)
    with pytest.raises(LeaseHeldError):
        collect_garbage(str(store), keep=2)
    res = collect_garbage(str(store), keep=2, takeover=True)
    assert res["versions_kept"] == [a, b] and res["bytes_freed"] > 0
    assert audit_store(str(store), coordinates=8, seed=0).ok
    with pytest.raises(ValueError, match="--keep=1"):
        collect_garbage(str(store), keep=1)


@pytest.fixture(scope="module")
def emb_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cocoon_ckpt.embedding import EmbeddingConfig

    root = tmp_path_factory.mktemp("emb") / "emb.zarr"
    cfg = job_config(
        "dlrm",
        bands=4,
        steps=12,
        embedding=EmbeddingConfig(mode="coalesced", threat_model="final_model", hot_threshold=2),
    )
    run_job(cfg, str(root))
    return root


def test_coalesced_csc_is_recomputed_and_tampering_found(emb_store: Path, tmp_path: Path) -> None:
    """A coalesced store: audit rebuilds the schedule from the job, recomputes random cold
    rows' entries from the key bit for bit; a CSC altered with valid checksums is found."""
    root = tmp_path / "emb.zarr"
    shutil.copytree(emb_store, root)
    before = tree(root)
    clean = audit_store(str(root), coordinates=64, seed=5, job="example:dlrm")
    assert clean.ok and not clean.skipped, clean.text()
    emb = clean.checks["embedding"]
    assert emb["entries_recomputed"] == emb["bit_identical"] > 0
    # the hot rows' online rings, regenerated from each table's key
    assert emb["online_slots"] == emb["online_slots_bit_identical"] > 0
    assert "final_model" in clean.info["threat_model"]
    assert tree(root) == before

    m = json.loads(_manifests(root)[-1].read_text())
    name = next(n for n in m["arrays"] if n.endswith("csc/values"))
    _scale_with_valid_checksums(root, m["arrays"][name]["path"])
    report = audit_store(str(root), coordinates=64, seed=5, job="example:dlrm")
    found = _findings(report, "embedding")
    assert found and "differ from the stored CSC" in found[0]
    assert not _findings(report, "checksums")

    ring = next(n for n in m["arrays"] if n.startswith("emb/") and "/ring/" in n)
    _scale_with_valid_checksums(root, m["arrays"][ring]["path"])
    report = audit_store(str(root), coordinates=64, seed=5)
    assert any("online ring slot" in f for f in _findings(report, "embedding"))


_MARKER_JOB = """
import os
from pathlib import Path

Path(os.environ["MARKER_DIR"], "imported").write_text("the store's job ran")


def build(config):
    from cocoon_ckpt.examples.dlrm import build as dlrm

    Path(os.environ["MARKER_DIR"], "built").write_text("the job was built")
    return dlrm(config)
"""


def test_audit_never_runs_the_job_a_store_names(
    emb_store: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The store's config names a module on the path that writes a marker when imported:
    audit skips the checks that need the job and says so; only a job the user names runs."""
    root = tmp_path / "emb.zarr"
    shutil.copytree(emb_store, root)
    code = tmp_path / "code"
    code.mkdir()
    (code / "marker_job.py").write_text(_MARKER_JOB)
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("MARKER_DIR", str(tmp_path))

    def rename(doc: dict[str, Any]) -> None:
        rec = doc["records"]
        rec["config"]["job"] = "marker_job:build"
        # re-stamped as the writer computes it (config, shapes and the job's identity)
        rec["fingerprint"] = doc["job_fingerprint"] = fingerprint(
            rec["config"], rec["model_shapes"], rec.get("identity")
        )

    _edit_manifests(root, rename)
    report = audit_store(str(root), coordinates=16, seed=1)
    assert not (tmp_path / "imported").exists() and not (tmp_path / "built").exists()
    assert report.ok, report.text()  # skipping is not a finding
    (skipped,) = report.skipped
    assert "marker_job:build" in skipped and "--job" in skipped and "--example" in skipped
    assert "entries_recomputed" not in report.checks["embedding"]
    assert report.checks["embedding"]["online_slots_bit_identical"] > 0  # no job needed
    assert "SKIPPED" in report.text()
    # named by the user, it runs, and the schedule checks with it
    ran = audit_store(str(root), coordinates=16, seed=1, job="marker_job:build")
    assert (tmp_path / "built").read_text() == "the job was built"
    emb = ran.checks["embedding"]
    assert ran.ok and not ran.skipped and emb["entries_recomputed"] == emb["bit_identical"] > 0
    # the CLI: --example names a built-in job for the same checks
    args = ["audit", str(root), "--coordinates", "8", "--seed", "1", "--json"]
    assert main([*args, "--example", "dlrm"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == []
    assert main(args) == 0
    assert "--example" in json.loads(capsys.readouterr().out)["skipped"][0]


def _newest(root: Path) -> int:
    return int(json.loads(_manifests(root)[-1].read_text())["version"])


@pytest.mark.parametrize("forge", ["label", "shape"])
def test_forged_label_or_shape_is_found_before_any_work(
    store: Path, forge: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ring slot labelled step 10^12 (audit would regenerate 10^12 steps), or an array
    recorded as 10^12 floats (reading it allocates 4 TB): a bounds finding, fast."""

    def edit(doc: dict[str, Any]) -> None:
        shard = doc["records"]["noise"]["shards"][0]
        name = shard["slots"][0][2]
        if forge == "label":
            shard["slots"][0][1] = 10**12
        else:
            doc["arrays"][name]["shape"] = [10**12]

    _edit_manifests(store, edit, only=_newest(store))
    tracemalloc.start()
    report = audit_store(str(store), coordinates=64, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    found = _findings(report, "bounds")
    assert found and ("outside [13, 16)" in found[0] if forge == "label" else "allows" in found[0])
    # no work past the job's own steps (not a clock bound: the suite runs on busy
    # machines), nothing of the forged size allocated
    steps = json.loads(_manifests(store)[0].read_text())["records"]["config"]["dp"]["steps"]
    assert report.checks["noise"]["steps_regenerated"] <= steps and peak < 64 << 20, peak
    assert report.checks["noise"]["slots"] > 0  # the other versions' slots still checked
    assert main(["audit", str(store), "--coordinates", "8", "--seed", "0"]) == 1
    assert "FINDING [bounds]" in capsys.readouterr().out


def test_links_out_of_the_store_are_followed(store: Path) -> None:
    """versions/ moved to a world-readable folder elsewhere and linked back: the files
    are readable by others through their own path, whatever the store root's mode."""
    elsewhere = Path(tempfile.mkdtemp())
    try:
        shutil.move(str(store / "versions"), elsewhere / "versions")
        (store / "versions").symlink_to(elsewhere / "versions")
        for p in [elsewhere, *elsewhere.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        way = [elsewhere, *elsewhere.parents]
        if not all(os.stat(p).st_mode & 0o001 for p in way):
            pytest.skip(f"a folder above {elsewhere} is closed to others: nothing to expose")
        report = audit_store(str(store), coordinates=8, seed=0)
        found = _findings(report, "permissions")
        assert any("read by others" in f and "versions/" in f for f in found), found
        assert any("links lead out of the store" in f for f in found)
        assert "others" in report.info["readable_by"]
        # closed again: the link itself is still a finding, the exposure is gone
        os.chmod(elsewhere, 0o700)
        found = _findings(audit_store(str(store), coordinates=8, seed=0), "permissions")
        assert not any("read by others" in f for f in found)
        assert any("links lead out of the store" in f for f in found)
    finally:
        shutil.rmtree(elsewhere)


def test_secure_mode_store_is_regenerated_with_its_own_generator(tmp_path: Path) -> None:
    """The audit regenerates a secure-mode job's noise with ChaCha20, not the default:
    every stored slot matches bit for bit (with the default generator none would)."""
    root = tmp_path / "secure.zarr"
    plain = job_config("mlp", bands=3, steps=6, keep_last=2)
    cfg = dataclasses.replace(plain, dp=dataclasses.replace(plain.dp, noise_rng="secure"))
    run_job(cfg, str(root))
    report = audit_store(str(root), coordinates=2_000, seed=1)
    assert report.ok, report.text()
    noise = report.checks["noise"]
    assert noise["slots"] == noise["bit_identical"] > 0
