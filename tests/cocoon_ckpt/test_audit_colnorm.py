"""The audit of an untouched column-normalized BandMF store finds nothing: the ring
keeps C_T^-1 z, and the step returns it scaled by s_t < 1 in the last b-1 steps, so the
audit must regenerate what the ring keeps (`NoiseMechanism.regenerate_rows`), not what
the step returned (it once compared the latter and reported the tail's slots as
altered). The real entry point, in subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cocoon_ckpt.dp.mechanism import BandMF
from state import Store

STEPS, BANDS = 12, 4


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cocoon_ckpt", *args], capture_output=True, text=True, timeout=600
    )


def test_an_untouched_colnorm_store_audits_clean(tmp_path: Path) -> None:
    store, key = str(tmp_path / "s.zarr"), str(tmp_path / "k")
    train = _run(
        "train",
        "--example",
        "mlp",
        "--store",
        store,
        "--key-file",
        key,
        "--steps",
        str(STEPS),
        "--bands",
        str(BANDS),
        "--mechanism",
        "optimized_colnorm",
        "--checkpoint-every",
        "5",
        "--no-progress",
        "--json",
    )
    assert train.returncode == 0, train.stderr
    latest = Store.open(store, create=False).latest()
    assert latest is not None and latest.step == STEPS
    mech = BandMF.from_state_dict(latest.records["mechanism"])
    labels = [s[1] for s in latest.records["noise"]["shards"][0]["slots"]]
    # the newest version's slots are the tail, where s_t < 1
    assert sorted(labels) == list(range(STEPS - BANDS + 1, STEPS))
    assert all(mech.noise_scale(t) < 1.0 for t in labels)

    audit = _run("audit", store, "--key-file", key, "--seed", "3", "--json")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    report = json.loads(audit.stdout)
    noise = report["checks"]["noise"]
    assert noise["slots"] > 0 and noise["bit_identical"] == noise["slots"]
    assert noise["max_deviation"] == 0.0
