"""I3 with real processes: SIGKILL `cocoon-ckpt train` at random moments, rerun until
done; the exported model equals the uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cocoon_ckpt._cli.main import main
from state import Store

pytestmark = pytest.mark.slow


def _cmd(
    store: Path | str,
    key: Path,
    example: str,
    bands: int,
    opts: dict[str, Any] | None = None,
    embedding: str | None = None,
    mechanism: str | None = None,
) -> list[str]:
    extra = ["--storage-options", json.dumps(opts)] if opts else []
    if embedding is not None:
        extra += ["--embedding", embedding, "--threat-model", "final_model"]
    if mechanism is not None:
        extra += ["--mechanism", mechanism]
    return [
        *(sys.executable, "-m", "cocoon_ckpt", "train", "--example", example),
        *("--store", str(store), "--key-file", str(key), "--steps", "30"),
        *("--checkpoint-every", "4", "--bands", str(bands), "--batch-size", "16"),
        *("--dataset-size", "512", "--no-progress", *extra),
    ]


def _export(
    store: Path | str, out: Path, key: Path, opts: dict[str, Any] | None = None
) -> dict[str, torch.Tensor]:
    """`cocoon-ckpt export` through the CLI's own entry point, in this process (the
    killed processes are the subjects; the export is not), authenticated by the key file
    (a final_model job is exported only so)."""
    extra = ["--key-file", str(key)]
    extra += ["--storage-options", json.dumps(opts)] if opts else []
    assert main(["export", str(store), "--out", str(out), *extra]) == 0
    return torch.load(out)  # type: ignore[no-any-return]


class Gold:
    """Exported models of uninterrupted runs, each trained once per module through the
    same `cocoon-ckpt train` arguments in this process, and the key file every run of
    the module shares (bit-identity needs one key)."""

    def __init__(self, root: Path) -> None:
        self.root, self.key = root, root / "noise.key"
        self._models: dict[str, dict[str, torch.Tensor]] = {}

    def model(
        self,
        example: str,
        bands: int,
        embedding: str | None = None,
        mechanism: str | None = None,
    ) -> dict[str, Any]:
        name = f"{example}-{bands}-{embedding}-{mechanism}"
        if name not in self._models:
            store = self.root / f"{name}.zarr"
            cmd = _cmd(store, self.key, example, bands, embedding=embedding, mechanism=mechanism)
            assert main(cmd[3:]) == 0
            self._models[name] = _export(store, self.root / f"{name}.pt", self.key)
        return self._models[name]


@pytest.fixture(scope="module")
def gold(tmp_path_factory: pytest.TempPathFactory) -> Gold:
    return Gold(tmp_path_factory.mktemp("kill-gold"))


def _manifests(store: Path) -> set[Path]:
    folder = store / "manifests"
    return set(folder.glob("*.json")) if folder.exists() else set()


@pytest.mark.parametrize(
    ("example", "bands", "embedding", "mechanism"),
    [
        ("mlp", 1, None, None),
        ("mlp", 8, None, None),
        # the BLT's d buffers (every version stores them all) and its stored parameters
        ("mlp", 4, None, "blt"),
        # the precomputed CSC, the hot rows' rings and the cursor resume together
        ("dlrm", 8, "coalesced", None),
        # lazy b=1 noise is keyed by (row, gap): a resume redraws the same values
        ("dlrm", 1, "lazy", None),
    ],
)
def test_sigkill_anywhere_then_resume_matches_uninterrupted(
    tmp_path: Path,
    gold: Gold,
    example: str,
    bands: int,
    embedding: str | None,
    mechanism: str | None,
) -> None:
    key = gold.key

    def cmd(store: Path) -> list[str]:
        return _cmd(store, key, example, bands, embedding=embedding, mechanism=mechanism)

    store = tmp_path / "run.zarr"
    rng = random.Random(f"{example}-{bands}-{embedding}-{mechanism}")
    env = dict(os.environ)
    kills: list[str] = []
    # First a kill inside a checkpoint write (arrays durable, manifest not yet written).
    env_crash = {**env, "COCOON_CRASH_AT": "checkpoint.after_arrays:step=12"}
    proc = subprocess.run(cmd(store), env=env_crash, capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    latest = Store.open(str(store), create=False).latest()
    assert latest is not None and latest.step == 8  # the half-written version 12 is invisible
    for attempt in range(4):
        err = tmp_path / f"attempt{attempt}.err"
        with err.open("wb") as f:
            p = subprocess.Popen(cmd(store), stdout=subprocess.DEVNULL, stderr=f)
        try:
            if attempt == 0:  # a moment from launch on: start-up, building, first steps
                p.wait(timeout=rng.uniform(2.0, 6.0))
            elif attempt == 1:  # a moment after its first own commit: steps, writes
                seen = _manifests(store)
                while not _manifests(store) - seen and p.poll() is None:
                    time.sleep(0.01)
                p.wait(timeout=rng.uniform(0.0, 0.3))
            else:  # then finish
                p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills.append(f"attempt {attempt}")
            continue
        assert p.returncode == 0, err.read_text()
        break
    else:
        pytest.fail("the job never finished")
    got = _export(store, tmp_path / "got.pt", gold.key)
    want = gold.model(example, bands, embedding, mechanism)
    assert all(torch.equal(want[k], got[k]) for k in want), f"after kills at {kills}"
    versions = Store.open(str(store), create=False)
    for v in versions.versions():
        versions.read(v)  # every version left verifies


def test_sigkill_on_s3_then_resume_matches_uninterrupted(
    tmp_path: Path, s3_endpoint: dict[str, Any], gold: Gold
) -> None:
    """The same on a real S3 endpoint: the commit is a conditional PUT, not a link. The
    uninterrupted run it must equal is the local one (the store does not change the
    math)."""
    key = gold.key
    opts = s3_endpoint["storage_options"]
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
    # this process listed the store before the other processes wrote to it; fsspec
    # shares one cached S3 filesystem per process, so drop its listings first
    Store.open(url, storage_options=opts, create=False).backend.fs.invalidate_cache()
    got = _export(url, tmp_path / "got.pt", key, opts)
    want = gold.model("mlp", 8)
    assert all(torch.equal(want[k], got[k]) for k in want)
