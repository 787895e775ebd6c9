"""docs/getting-started.md as a reader follows it: its `myjob.py` and its train command
as written, killed by SIGKILL in its second checkpoint and run again (it says it
resumes), then its inspect, audit and export commands."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from state import Store

from .blocks import block, commands

PAGE = "docs/getting-started.md"


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_getting_started_job_trains_resumes_and_exports(tmp_path: Path) -> None:
    (tmp_path / "myjob.py").write_text(block(PAGE, "getting-started:myjob.py"))
    [train] = commands(block(PAGE, "getting-started:train"))
    # killed (SIGKILL) inside the checkpoint of step 20: its arrays are written, its
    # manifest is not, so the newest version is step 10's
    crash = {**os.environ, "COCOON_CRASH_AT": "checkpoint.after_arrays:step=20"}
    killed = subprocess.run(train, cwd=tmp_path, env=crash, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # stderr is a pipe: one line at the start, then one per checkpoint taken, in order;
    # how many are out before the kill is timing (each line's epsilon is composed on a
    # thread of its own, late on a busy machine; steps go on while step 20's version is
    # written in the background)
    lines = killed.stderr.splitlines()
    assert "job myjob:build on runs/points.zarr: a new run of 40 steps" in lines[0], lines
    taken = [ln.split(":")[0] for ln in lines[1:]]
    assert taken == ["step 10/40", "step 20/40", "step 30/40"][: len(taken)], lines
    url = str(tmp_path / "runs" / "points.zarr")
    resumed_at = Store.open(url, create=False).latest().step  # type: ignore[union-attr]
    assert resumed_at == 10
    again = _run([*train, "--json"], tmp_path)
    assert again.returncode == 0, again.stderr
    # (a warning may come first: the dead writer's lease is taken over)
    [start] = [ln for ln in again.stderr.splitlines() if ln.startswith("train: ")]
    assert start.endswith(f": resuming at step {resumed_at} of 40, a checkpoint every 10 steps")
    # a finished run writes every checkpoint's line before it exits
    steps = [ln.split(":")[0] for ln in again.stderr.splitlines() if ln.startswith("step ")]
    assert steps == ["step 20/40", "step 30/40", "step 40/40"], again.stderr
    result = json.loads(again.stdout)
    assert result["resumed_from"] == resumed_at and result["steps"] == 40
    assert result["epsilon"] <= 4.0  # the target holds
    inspect, audit, export = commands(block(PAGE, "getting-started:inspect"))
    for argv in (inspect, audit, export):
        done = _run(argv, tmp_path)
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
    report = json.loads((tmp_path / "points.pt.privacy.json").read_text())
    assert report["epsilon"] == result["epsilon"]
