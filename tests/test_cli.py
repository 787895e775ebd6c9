"""The real entry point, in subprocesses: exit codes, JSON, one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args], capture_output=True, text=True, timeout=300
    )


def test_train_resume_export_json(tmp_path: Path) -> None:
    store = str(tmp_path / "s.zarr")
    common = [
        "train",
        "--example",
        "mlp",
        "--store",
        store,
        "--steps",
        "12",
        "--checkpoint-every",
        "4",
        "--no-progress",
        "--json",
    ]
    first = _run(*common)
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["steps"] == 12 and out["resumed_from"] is None and out["epsilon"] > 0
    again = _run(*common)  # a finished job: resumes at the end, trains nothing more
    assert json.loads(again.stdout)["resumed_from"] == 12
    exp = _run("export", store, "--out", str(tmp_path / "m.pt"), "--json")
    assert exp.returncode == 0, exp.stderr
    report = json.loads(exp.stdout)
    assert report["threat_model"] == "intermediate_iterates" and report["bands"] == 8
    state = torch.load(tmp_path / "m.pt")
    assert set(state) == {"0.weight", "0.bias", "2.weight", "2.bias"}  # no noise state
    assert json.loads((tmp_path / "m.pt.privacy.json").read_text())["epsilon"] == report["epsilon"]


def test_errors_are_one_line_with_exit_codes(tmp_path: Path) -> None:
    store = str(tmp_path / "s.zarr")
    ok = _run("train", "--store", store, "--steps", "8", "--checkpoint-every", "4", "--no-progress")
    assert ok.returncode == 0, ok.stderr
    changed = _run("train", "--store", store, "--steps", "8", "--bands", "2", "--no-progress")
    assert changed.returncode == 1
    assert changed.stderr.count("\n") == 1 and "dp.bands: stored 8, now 2" in changed.stderr
    bad = _run(
        "train", "--store", str(tmp_path / "t.zarr"), "--noise-multiplier", "0", "--no-progress"
    )
    assert bad.returncode == 2 and "noise_multiplier" in bad.stderr
    missing = _run("export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.pt"))
    assert missing.returncode == 2 and "holds no cocoon-ckpt store" in missing.stderr
    assert not (tmp_path / "nothing").exists()  # export creates nothing
    usage = _run("train", "--steps", "many")
    assert usage.returncode == 2
    opts = _run("train", "--store", store, "--storage-options", "{not json", "--no-progress")
    assert opts.returncode == 2 and "--storage-options is not valid JSON" in opts.stderr


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): f"{p.lstat().st_mode:o}:"
        + (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "")
        for p in sorted(root.rglob("*"))
    }


def test_inspect_audit_diff_gc_in_subprocesses(tmp_path: Path) -> None:
    store = str(tmp_path / "s.zarr")
    first = _run(
        "train", "--store", store, "--steps", "12", "--checkpoint-every", "3", "--bands", "4",
        "--no-progress",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    insp = _run("inspect", store, "--json")
    assert insp.returncode == 0, insp.stderr
    out = json.loads(insp.stdout)
    versions = [v["version"] for v in out["versions"]]
    assert [v["step"] for v in out["versions"]] == [6, 9, 12]  # keep_last 3
    assert out["job"]["threat_model"] == "intermediate_iterates"
    text = _run("inspect", store)
    assert text.returncode == 0 and "on host, 3 slots" in text.stdout
    one = json.loads(_run("inspect", store, "--version", str(versions[-1]), "--json").stdout)
    assert one["config"]["dp"]["steps"] == 12

    # the recorded config reruns the same job: nothing left to train
    cfg = tmp_path / "job.json"
    cfg.write_text(json.dumps(one["config"]))
    again = _run("train", "--config", str(cfg), "--store", store, "--no-progress", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["resumed_from"] == 12

    audit = _run("audit", store, "--json", "--plot", str(tmp_path / "plots"))
    assert audit.returncode == 0, audit.stdout + audit.stderr
    rep = json.loads(audit.stdout)
    assert rep["ok"] and rep["checks"]["noise"]["slots"] > 0 and len(rep["plots"]) == 4
    assert "all checks hold" in _run("audit", store, "--seed", "1").stdout

    d = _run("diff", store, str(versions[0]), str(versions[1]), "--json")
    assert d.returncode == 0 and json.loads(d.stdout)["records_changed"]["trainer.step"] == {
        "from": 6,
        "to": 9,
    }
    assert "arrays added" in _run("diff", store, str(versions[0]), str(versions[1])).stdout

    os.chmod(store, 0o755)  # anyone may now list and read the store
    bad = _run("audit", store)
    assert bad.returncode == 1 and "FINDING [permissions]" in bad.stdout
    os.chmod(store, 0o700)

    gc = _run("gc", store, "--keep", "2", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["versions_kept"] == versions[1:]
    assert _run("audit", store).returncode == 0


def test_bad_input_is_one_line_exit_2_and_changes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "s.zarr"
    keyed = tmp_path / "k.zarr"
    ok = _run(
        "train", "--store", str(store), "--steps", "8", "--checkpoint-every", "4", "--no-progress"
    )
    assert ok.returncode == 0, ok.stderr
    ok = _run(
        "train", "--store", str(keyed), "--steps", "8", "--key-file", str(tmp_path / "key"),
        "--no-progress",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    newer = tmp_path / "newer.zarr"
    shutil.copytree(store, newer)
    root = json.loads((newer / "zarr.json").read_text())
    root["attributes"]["cocoon_ckpt"]["format_version"] = 99
    (newer / "zarr.json").write_text(json.dumps(root))
    (tmp_path / "notastore").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    before = {p: _tree(p) for p in (store, keyed, newer, tmp_path / "notastore")}
    cases = [
        (("inspect", str(tmp_path / "notastore")), "holds no cocoon-ckpt store"),
        (("audit", str(tmp_path / "notastore")), "holds no cocoon-ckpt store"),
        (("gc", str(tmp_path / "notastore"), "--keep", "2"), "holds no cocoon-ckpt store"),
        (("inspect", str(newer)), "upgrade cocoon-ckpt"),
        (("audit", str(newer)), "upgrade cocoon-ckpt"),
        (("train", "--store", str(newer), "--no-progress"), "upgrade cocoon-ckpt"),
        (("audit", str(keyed)), "--key-file"),
        (("audit", str(keyed), "--key-file", str(tmp_path / "nokey")), "cannot read key file"),
        (("train", "--store", str(keyed), "--steps", "8", "--no-progress"), "--key-file"),
        (("inspect", str(store), "--version", "99"), "has no version 99"),
        (("diff", str(store), "1", "99"), "has no version 99"),
        (
            ("train", "--config", str(tmp_path / "bad.json"), "--store", str(store)),
            "not valid JSON",
        ),
        (("train", "--config", str(tmp_path / "none.json"), "--store", str(store)), "cannot read"),
        (("train", "--config", str(tmp_path / "bad.json"), "--steps", "3"), "drop --steps"),
        (("gc", str(store), "--keep", "1"), "--keep=1 must be >= 2"),
        (("audit", str(store), "--coordinates", "0"), "coordinates=0"),
    ]
    for args, needle in cases:
        res = _run(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert res.stderr.count("\n") == 1 and needle in res.stderr, (args, res.stderr)
        assert res.stderr.startswith("cocoon-ckpt: error: ")
    assert {p: _tree(p) for p in before} == before
    assert not (tmp_path / "nokey").exists()


def test_help_explains_every_subcommand() -> None:
    top = _run("--help")
    for cmd in ("train", "export", "inspect", "audit", "diff", "gc", "chaos"):
        assert cmd in top.stdout
        sub = _run(cmd, "--help")
        assert sub.returncode == 0 and "usage: cocoon-ckpt " + cmd in sub.stdout
    assert "(default 256" in _run("audit", "--help").stdout


def test_train_on_far_tier_and_inspect_shows_placement(tmp_path: Path) -> None:
    store = str(tmp_path / "far.zarr")
    tiers = json.dumps({"host_bytes": 0, "far_bytes": 1 << 28, "far_dir": str(tmp_path)})
    res = _run(
        "train", "--store", store, "--steps", "6", "--checkpoint-every", "3", "--bands", "3",
        "--tiers", tiers, "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "on far, 2 slots" in _run("inspect", store).stdout
    assert [p.name for p in tmp_path.iterdir()] == ["far.zarr"]  # the far folder is gone
    bad = _run("train", "--store", store, "--tiers", '{"hots_bytes": 1}', "--no-progress")
    assert bad.returncode == 2 and "--tiers" in bad.stderr and "TierConfig" in bad.stderr
