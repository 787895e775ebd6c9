from __future__ import annotations

import json
import subprocess
import sys

from fault_injection import run_chaos

from ..cocoon_ckpt.conftest import job_config


def test_seeded_chaos_sample_finds_nothing_wrong() -> None:
    report = run_chaos(job_config("mlp", bands=8, steps=24), trials=8, seed=7)
    assert report.ok, report.failures
    assert report.trials == 8 and report.resumes >= 8
    assert report.faults["storage: transient"] > 0
    assert report.detected_corruptions == report.faults["bit flip at rest"]
    assert report.undetected_corruptions == 0 and report.lost_versions == 0


def test_chaos_cli_json_and_exit_code() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cocoon_ckpt",
            "chaos",
            "--example",
            "dlrm",
            "--trials",
            "3",
            "--seed",
            "2",
            "--kill-trials",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] and report["trials"] == 3 and report["divergences"] == 0
    assert report["kill_trials"] == 1 and report["resumes"] >= 3
    bad = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "chaos", "--trials", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--trials=0" in bad.stderr
