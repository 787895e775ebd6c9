"""The real entry point, in subprocesses: exit codes, JSON, one-line errors."""

from __future__ import annotations

import json
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
    assert missing.returncode == 1 and "holds no cocoon-ckpt store" in missing.stderr
    assert not (tmp_path / "nothing").exists()  # export creates nothing
    usage = _run("train", "--steps", "many")
    assert usage.returncode == 2
    opts = _run("train", "--store", store, "--storage-options", "{not json", "--no-progress")
    assert opts.returncode == 2 and "--storage-options is not valid JSON" in opts.stderr
