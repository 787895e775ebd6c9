"""I3 with real processes: SIGKILL `cocoon-ckpt train` at random moments, rerun until
done; the exported model equals the uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from state import Store

pytestmark = pytest.mark.slow


def _cmd(
    store: Path | str,
    key: Path,
    example: str,
    bands: int,
    opts: dict[str, Any] | None = None,
    embedding: str | None = None,
) -> list[str]:
    extra = ["--storage-options", json.dumps(opts)] if opts else []
    if embedding is not None:
        extra += ["--embedding", embedding, "--threat-model", "final_model"]
    return [
        *(sys.executable, "-m", "cocoon_ckpt", "train", "--example", example),
        *("--store", str(store), "--key-file", str(key), "--steps", "30"),
        *("--checkpoint-every", "4", "--bands", str(bands), "--batch-size", "16"),
        *("--dataset-size", "512", "--no-progress", *extra),
    ]


def _export(
    store: Path | str, out: Path, opts: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    extra = ["--storage-options", json.dumps(opts)] if opts else []
    subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", "export", str(store), "--out", str(out), *extra],
        check=True,
        capture_output=True,
    )
    return torch.load(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("example", "bands", "embedding"),
    [
        ("mlp", 1, None),
        ("mlp", 8, None),
        # the precomputed CSC, the hot rows' rings and the cursor resume together
        ("dlrm", 8, "coalesced"),
        # lazy b=1 noise is keyed by (row, gap): a resume redraws the same values
        ("dlrm", 1, "lazy"),
    ],
)
def test_sigkill_anywhere_then_resume_matches_uninterrupted(
    tmp_path: Path, example: str, bands: int, embedding: str | None
) -> None:
    key = tmp_path / "noise.key"
    gold_store = tmp_path / "gold.zarr"

    def cmd(store: Path) -> list[str]:
        return _cmd(store, key, example, bands, embedding=embedding)

    subprocess.run(cmd(gold_store), check=True, capture_output=True)
    gold = _export(gold_store, tmp_path / "gold.pt")

    store = tmp_path / "run.zarr"
    rng = random.Random(f"{example}-{bands}-{embedding}")
    env = dict(os.environ)
    kills = 0
    # First a kill inside a checkpoint write (arrays durable, manifest not yet written).
    env_crash = {**env, "COCOON_CRASH_AT": "checkpoint.after_arrays:step=12"}
    proc = subprocess.run(cmd(store), env=env_crash, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 8  # the half-written version 12 is invisible
    for attempt in range(6):
        p = subprocess.Popen(cmd(store), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def test_sigkill_on_s3_then_resume_matches_uninterrupted(
    tmp_path: Path, s3_endpoint: dict[str, Any]
) -> None:
    """The same on a real S3 endpoint: the commit is a conditional PUT, not a link."""
    key = tmp_path / "noise.key"
    opts = s3_endpoint["storage_options"]
    gold_url = f"s3://{s3_endpoint['bucket']}/kill-gold.zarr"
    subprocess.run(_cmd(gold_url, key, "mlp", 8, opts), check=True, capture_output=True)
    gold = _export(gold_url, tmp_path / "gold.pt", opts)
    url = f"s3://{s3_endpoint['bucket']}/kill-run.zarr"
    env = {**os.environ, "COCOON_CRASH_AT": "checkpoint.before_manifest:step=16"}
    proc = subprocess.run(_cmd(url, key, "mlp", 8, opts), env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    latest = Store.open(url, storage_options=opts, create=False).latest()
    assert latest is not None and latest.step == 12
    rng = random.Random("s3")
    p = subprocess.Popen(
        _cmd(url, key, "mlp", 8, opts), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        p.wait(timeout=rng.uniform(2.0, 5.0))
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGKILL)
        p.wait()
    done = subprocess.run(_cmd(url, key, "mlp", 8, opts), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = _export(url, tmp_path / "got.pt", opts)
    assert all(torch.equal(gold[k], got[k]) for k in gold)
