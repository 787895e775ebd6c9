from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cocoon_ckpt._cli.main import main
from fault_injection import run_chaos
from fault_injection.chaos import _AT_REST

from ..cocoon_ckpt.conftest import job_config


def test_seeded_chaos_sample_finds_nothing_wrong() -> None:
    report = run_chaos(job_config("mlp", bands=8, steps=24), trials=8, seed=7)
    assert report.ok, report.failures
    assert report.trials == 8 and report.resumes >= 8
    assert report.faults["storage: transient"] > 0
    # chunk flips, manifest flips, out-of-store paths with re-stamped checksums: each
    # drawn, each detected on open
    at_rest = {k: n for k, n in report.faults.items() if k in _AT_REST}
    assert set(at_rest) == set(_AT_REST), at_rest
    assert report.detected_corruptions == sum(at_rest.values())
    assert report.undetected_corruptions == 0 and report.lost_versions == 0


def test_chaos_cli_json_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    # the command in this process through the CLI's entry point (its writers, golden run
    # and exports are subprocesses of their own); the exit code of a usage error below
    # comes from a real `python -m cocoon_ckpt`
    code = main(
        [
            *("chaos", "--example", "mlp", "--bands", "4"),
            *("--trials", "2", "--seed", "2", "--steps", "12", "--checkpoint-every", "3"),
            # SIGKILLed subprocesses: tests/cocoon_ckpt/test_kill.py kills the same way
            *("--kill-trials", "0", "--takeover-trials", "1", "--json"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, out + err  # findings are in the report on stdout
    report = json.loads(out)
    assert report["ok"] and report["trials"] == 2 and report["divergences"] == 0
    assert report["kill_trials"] == 0 and report["resumes"] >= 3
    # a writer frozen mid-run on the local S3 server, taken over, woken: fenced, one line
    assert report["takeover_trials"] == 1 and report["unfenced_commits"] == 0
    frozen = [k for k in report["faults"] if k.startswith("takeover of writer A frozen at")]
    assert len(frozen) == 1 and report["faults"][frozen[0]] == 1
    assert report["fenced_writers"] == 1
    bad = subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "chaos", "--trials", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--trials=0" in bad.stderr
