"""Without a terminal, `train` writes one line at the start and one per checkpoint on
stderr (a batch job's log shows progress as it goes); `--quiet` writes none."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

from cocoon_ckpt import DPConfig, JobConfig, run_job
from cocoon_ckpt._cli.progress import Progress
from state import Store

LINE = re.compile(
    r"step (\d+)/(\d+): loss (\d+\.\d{4}), epsilon (\d+\.\d{3}), version (\d+), "
    r"(\d+\.\d{3}|-) s/step"
)


def _train(store: str, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ("--store", store, "--steps", "6", "--bands", "2", "--checkpoint-every", "3")
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "train", "--example", "mlp", *args, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_log_gets_a_start_line_and_a_line_per_checkpoint(tmp_path: Path) -> None:
    store = str(tmp_path / "s.zarr")
    res = _train(store, "--json")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == (
        f"train: job example:mlp on {store}: a new run of 6 steps, a checkpoint every 3 steps"
    )
    found = [LINE.fullmatch(line) for line in lines[1:]]
    assert all(found), lines
    rows = [m.groups() for m in found if m]
    assert [(r[0], r[1], r[4]) for r in rows] == [("3", "6", "1"), ("6", "6", "2")]
    # the last line's epsilon and version are the job's result and the store's newest
    out = json.loads(res.stdout)
    assert rows[-1][3] == f"{out['epsilon']:.3f}"
    assert Store.open(store, create=False).versions()[-1] == out["version"] == 2


def test_quiet_writes_no_progress(tmp_path: Path) -> None:
    res = _train(str(tmp_path / "s.zarr"), "--quiet")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout.startswith("done: 6 steps")


def _steps_versions(lines: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for line in lines:
        m = LINE.fullmatch(line)
        pairs.append((m.group(1), m.group(5)) if m else ("no match", line))
    return pairs


def test_a_resume_says_so_and_numbers_the_versions_on(tmp_path: Path) -> None:
    url = str(tmp_path / "s.zarr")
    dp = DPConfig(steps=8, batch_size=16, dataset_size=512, noise_multiplier=1.0, bands=2)
    cfg = JobConfig(job="example:mlp", dp=dp, checkpoint_every=2)

    def run(stop_after: int | None) -> list[str]:
        out = io.StringIO()
        lines = Progress(8, 2, mode="lines", store=url, job=cfg.job, stream=out)
        try:
            run_job(cfg, url, on_step=lines.on_step, stop_after=stop_after)
        finally:
            lines.close()
        return out.getvalue().splitlines()

    first = run(stop_after=5)  # versions 1, 2 at steps 2, 4; step 5 is lost as in a crash
    assert first[0].endswith(": a new run of 8 steps, a checkpoint every 2 steps")
    assert _steps_versions(first[1:]) == [("2", "1"), ("4", "2")]
    second = run(stop_after=None)
    assert second[0] == (
        f"train: job example:mlp on {url}: resuming at step 4 of 8, a checkpoint every 2 steps"
    )
    assert _steps_versions(second[1:]) == [("6", "3"), ("8", "4")]
    assert Store.open(url, create=False).versions()[-1] == 4
