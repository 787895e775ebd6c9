"""Retention's sweep of temp files (`*.partial`) takes only those a dead writer left,
never a live writer's: it runs in the background after a commit, beside the same job's
heartbeat and its next commit. Deleting every temp file had failed a heartbeat's
rename ("renewing lease ... failed", seen once under load) and could fail a commit's
manifest link."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from state import Store, hooks
from state.paths import LEASES, MANIFESTS, SECRET
from state.retention import PARTIAL_GRACE_S, retain
from state.transaction import AFTER_MANIFEST_TEMP


def _commit(store: Store, step: int) -> None:
    txn = store.begin(step)
    txn.put_array("a", np.full(4, step, dtype=np.float32))
    txn.commit()


def test_a_commits_manifest_temp_file_survives_a_retention_beside_it(tmp_path: Path) -> None:
    # the manifest's temp file is durable and not yet linked when retention runs (as
    # the previous commit's background retention may): the commit must still land
    store = Store.open(str(tmp_path / "s"))
    store.acquire_lease()
    for step in range(3):
        _commit(store, step)
    swept: list[list[str]] = []

    def retention_now(_point: str, _ctx: object) -> None:
        temps = [n for n in os.listdir(tmp_path / "s" / MANIFESTS) if n.endswith(".partial")]
        assert temps, "the manifest's temp file should exist at this point"
        swept.append(retain(store))

    hooks.arm(AFTER_MANIFEST_TEMP, retention_now)
    try:
        _commit(store, 3)
    finally:
        hooks.disarm(AFTER_MANIFEST_TEMP)
    assert swept and not any(p.endswith(".partial") for p in swept[0])
    latest = store.latest()
    assert latest is not None and latest.step == 3


def test_a_dead_writers_temp_files_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s"))
    store.acquire_lease()
    _commit(store, 0)
    _commit(store, 1)
    root = tmp_path / "s"
    old = time.time() - 10 * PARTIAL_GRACE_S
    stale, fresh = [], []
    for top in (MANIFESTS, LEASES, SECRET):
        (root / top).mkdir(exist_ok=True)
        s = root / top / f"x.json.{top}dead.partial"
        s.write_bytes(b"{")
        os.utime(s, (old, old))
        stale.append(f"{top}/{s.name}")
        f = root / top / f"x.json.{top}live.partial"
        f.write_bytes(b"{")
        fresh.append(f"{top}/{f.name}")
    deleted = retain(store)
    assert sorted(p for p in deleted if p.endswith(".partial")) == sorted(stale)
    for rel in fresh:
        assert (root / rel).exists(), rel
    for rel in stale:
        assert not (root / rel).exists(), rel


_RENEWER = textwrap.dedent(
    """
    import sys
    from state import Store
    store = Store.open(sys.argv[1], create=False)
    lease = store.acquire_lease()
    print("ready", flush=True)
    for _ in range(int(sys.argv[2])):
        lease.renew()  # raises if its temp file is deleted before the rename
    print("done", flush=True)
    """
)


def test_a_heartbeat_renewed_in_another_process_survives_retention_sweeps(
    tmp_path: Path,
) -> None:
    # two real processes: one renews its lease's heartbeat (temp file + rename) again
    # and again, this one runs retention over the same store meanwhile
    url = str(tmp_path / "s")
    store = Store.open(url)
    lease = store.acquire_lease()
    _commit(store, 0)
    _commit(store, 1)
    lease.release()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _RENEWER, url, "400"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    sweeps = 0
    while proc.poll() is None:
        retain(Store.open(url, create=False))
        sweeps += 1
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == "done" and sweeps >= 1
