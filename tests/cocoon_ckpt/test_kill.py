"""I3 with real processes: SIGKILL `cocoon-ckpt train` at random moments, rerun until
done; the exported model equals the uninterrupted run's bit for bit."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from state import Store

pytestmark = pytest.mark.slow


def _cmd(store: Path, key: Path, example: str, bands: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cocoon_ckpt",
        "train",
        "--example",
        example,
        "--store",
        str(store),
        "--key-file",
        str(key),
        "--steps",
        "30",
        "--checkpoint-every",
        "4",
        "--bands",
        str(bands),
        "--batch-size",
        "16",
        "--dataset-size",
        "512",
        "--no-progress",
    ]


def _export(store: Path, out: Path) -> dict[str, torch.Tensor]:
    subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "export", str(store), "--out", str(out)],
        check=True,
        capture_output=True,
    )
    return torch.load(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("example", ["mlp", "dlrm"])
@pytest.mark.parametrize("bands", [1, 8])
def test_sigkill_anywhere_then_resume_matches_uninterrupted(
    tmp_path: Path, example: str, bands: int
) -> None:
    key = tmp_path / "noise.key"
    gold_store = tmp_path / "gold.zarr"
    subprocess.run(_cmd(gold_store, key, example, bands), check=True, capture_output=True)
    gold = _export(gold_store, tmp_path / "gold.pt")

    store = tmp_path / "run.zarr"
    rng = random.Random(f"{example}-{bands}")
    env = dict(os.environ)
    kills = 0
    # First a kill inside a checkpoint write (arrays durable, manifest not yet written).
    env_crash = {**env, "COCOON_CRASH_AT": "checkpoint.after_arrays:step=12"}
    proc = subprocess.run(_cmd(store, key, example, bands), env=env_crash, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 8  # the half-written version 12 is invisible
    for attempt in range(6):
        p = subprocess.Popen(
            _cmd(store, key, example, bands), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            # four kills at random moments (start-up, steps, checkpoint writes), then finish
            p.wait(timeout=rng.uniform(2.0, 6.0) if attempt < 4 else 300)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            continue
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
        break
    else:
        pytest.fail("the job never finished")
    got = _export(store, tmp_path / "got.pt")
    assert all(torch.equal(gold[k], got[k]) for k in gold)
    versions = Store.open(str(store), create=False)
    for v in versions.versions():
        versions.read(v)  # every version left verifies
