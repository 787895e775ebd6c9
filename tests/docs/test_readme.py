"""The README's own-job snippet runs as written, on a local store in a fresh folder,
and resumes when run again; its commands are the ones CI runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from state import Store

from .blocks import ROOT, block, commands


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_own_job_snippet_runs_resumes_and_exports(tmp_path: Path) -> None:
    code = block("README.md", "readme:own-job")
    assert len(code.strip().splitlines()) <= 22  # "about 20 lines"
    (tmp_path / "own_job.py").write_text(code)
    first = _run([sys.executable, "own_job.py"], tmp_path)
    assert first.returncode == 0, first.stderr
    printed = re.findall(r"step (\d+): loss \d+\.\d+, epsilon (\d+\.\d+)", first.stdout)
    assert [s for s, _ in printed] == ["19", "39", "59", "79", "99"]
    assert float(printed[-1][1]) <= 4.0  # the target epsilon holds
    url = str(tmp_path / "runs" / "mine.zarr")
    latest = Store.open(url, create=False).latest()
    assert latest is not None and latest.step == 100
    written = Store.open(url, create=False).versions()
    # run again: the job is done, so it resumes at its end, takes no step, writes nothing
    again = _run([sys.executable, "own_job.py"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == ""
    assert Store.open(url, create=False).versions() == written
    # the export the README names after the snippet
    text = (ROOT / "README.md").read_text()
    export = re.search(r"`(cocoon-ckpt export runs/mine.zarr --out mine.pt)`", text)
    assert export is not None, "README: the export command after the own-job snippet"
    [argv] = commands(export.group(1))
    done = _run([*argv, "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["epsilon"] <= 4.0
    assert (tmp_path / "mine.pt").exists() and (tmp_path / "mine.pt.privacy.json").exists()


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n logical" in readme
    assert "python -m pytest -q -n logical" in ci.splitlines()
