"""The writer lease: fencing that no cache hides (two real processes on S3), and expiry."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import state.lease
from state import FencedError, LeaseHeldError, Store, hooks

ROOT = Path(__file__).resolve().parents[2]

# A writer that commits a small version every 50 ms until it is fenced (exit 3), for at
# most 20 s (exit 0: never fenced).
_HOLDER = """
import json, sys, time
import numpy as np
from state import FencedError, Store
url, opts = sys.argv[1], json.loads(sys.argv[2])
store = Store.open(url, storage_options=opts)
store.acquire_lease()
deadline = time.time() + 20
step = 0
while time.time() < deadline:
    step += 1
    try:
        txn = store.begin(step)
        txn.put_array("a", np.full(4, step))
        print("committed", txn.commit().version, flush=True)
    except FencedError as exc:
        print("fenced", exc, flush=True)
        sys.exit(3)
    time.sleep(0.05)
"""

# The new writer: on a line from stdin takes the lease over, then (as a resuming job reads
# the newest version first) commits one version of its own.
_TAKER = """
import json, sys, time
import numpy as np
from state import Store
url, opts = sys.argv[1], json.loads(sys.argv[2])
store = Store.open(url, storage_options=opts)
sys.stdin.readline()
store.acquire_lease(takeover=True)
print("seen", json.dumps(store.versions()), flush=True)
time.sleep(0.3)
txn = store.begin(1000)
txn.put_array("a", np.zeros(4))
print("committed", txn.commit().version, flush=True)
"""


def _python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_writer_taken_over_on_s3_by_another_process_is_fenced(
    s3_endpoint: dict[str, Any],
) -> None:
    """s3fs caches directory listings per process: the lease check must not read one."""
    url = f"s3://{s3_endpoint['bucket']}/{uuid.uuid4().hex}.zarr"
    opts = json.dumps(s3_endpoint["storage_options"])
    holder = _python(_HOLDER, url, opts)
    taker = _python(_TAKER, url, opts)  # starts up meanwhile, then waits for its cue
    try:
        assert holder.stdout is not None
        for _ in range(2):  # the holder has committed twice (its listings are cached)
            assert holder.stdout.readline().startswith("committed"), holder.stderr
        t_out, t_err = taker.communicate("take over\n", timeout=60)
        h_out, h_err = holder.communicate(timeout=60)
    finally:
        holder.kill()
        taker.kill()
    assert taker.returncode == 0, t_err
    assert holder.returncode == 3, h_out + h_err
    (fenced,) = [line for line in h_out.splitlines() if line.startswith("fenced")]
    assert "(lease generation 1) was taken over by generation 2; it may not commit" in fenced
    seen = set(json.loads(t_out.splitlines()[0].split(" ", 1)[1]))
    taker_version = int(t_out.splitlines()[1].split()[1])

    store = Store.open(url, storage_options=s3_endpoint["storage_options"], create=False)
    by_gen = {v: store.manifest(v).writer["generation"] for v in store.versions()}
    assert by_gen[taker_version] == 2
    # After the takeover the old writer lands at most the one commit whose lease check
    # came before it (the documented window), and nothing after that.
    late = [v for v, g in by_gen.items() if g == 1 and v not in seen]
    assert len(late) <= 1 and all(v < taker_version for v in late)


def _foreign_record(store: Store, *, gen: int) -> None:
    """A lease record of generation `gen` taken now by a writer on another host, with an
    expiry of 0.8 s."""
    now = time.time()
    rec = {
        "owner": "far-away:4242:deadbeef",
        "generation": gen,
        "host": "far-away",
        "pid": 4242,
        "proc_start": "1",
        "acquired": "2026-01-01T00:00:00+00:00",
        "renewed": now,
        "expiry_s": 0.8,
    }
    store.backend.makedirs("leases")
    store.backend.create_once(f"leases/{gen:08d}.json", json.dumps(rec).encode())


def _open(loc: dict[str, Any]) -> Store:
    return Store.open(loc["url"], storage_options=loc["storage_options"])


def test_expired_lease_of_a_dead_foreign_host_is_taken_without_takeover(
    store_location: dict[str, Any],
) -> None:
    store = _open(store_location)
    _foreign_record(store, gen=1)
    with pytest.raises(LeaseHeldError, match=r"on host far-away, renewed \d+ s ago; it expires"):
        _open(store_location).acquire_lease()
    assert store.backend.listdir("leases") == ["00000001.json"]  # a refusal writes nothing
    time.sleep(0.8)  # its writer never renewed it: now it has expired
    lease = _open(store_location).acquire_lease(expiry_s=0.5)
    assert lease.generation == 2
    lease.release()


class _Clock:
    """lease.py's `time` module with a wall clock that moves only when the test says:
    renewal and expiry are judged at chosen instants, however late the heartbeat
    thread runs on a busy machine."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _until(done: Any, what: str) -> None:
    """Poll `done()` (no deadline of its own: pytest-timeout bounds the test)."""
    while not done():
        time.sleep(0.01)


def test_live_writer_keeps_renewing_and_is_fenced_once_it_stops(
    store_location: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Judge this process's own lease as another host would: by its expiry alone.
    monkeypatch.setattr(state.lease, "owner_alive", lambda *_: None)
    clock = _Clock(1_000_000.0)
    monkeypatch.setattr(state.lease, "time", clock)
    first = _open(store_location)
    running = set(threading.enumerate())
    lease = first.acquire_lease(expiry_s=0.3)  # the heartbeat wakes every 0.1 s
    # this lease's heartbeat: another test's store in this process may also be at
    # generation 1, its heartbeat (a thread of the same name) still waiting
    (heartbeat,) = (
        t
        for t in set(threading.enumerate()) - running
        if t.name == f"lease-heartbeat-g{lease.generation}"
    )
    # Past the acquisition's expiry: only the heartbeat thread's renewal keeps it alive.
    clock.now += 0.25
    _until(lambda: lease.renewed == clock.now, "the heartbeat renews")
    clock.now += 0.25
    with pytest.raises(LeaseHeldError, match="a second writer is refused"):
        _open(store_location).acquire_lease()
    lease._stop.set()  # the holder hangs: its heartbeat stops, its lease expires
    heartbeat.join()
    clock.now = lease.renewed + 0.3
    second = _open(store_location)
    assert second.acquire_lease(expiry_s=0.3).generation == 2
    with pytest.raises(FencedError, match="taken over by generation 2"):
        first.begin(1)
    txn = second.begin(1)
    txn.put_array("a", np.zeros(2))
    assert txn.commit().writer["generation"] == 2
    second.release_lease()


def test_expiry_must_be_a_positive_number(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="lease expiry_s=.* must be a finite number"):
            store.acquire_lease(expiry_s=bad)
    assert store.backend.listdir("leases") == []


def test_takeover_inside_the_commit_window_forks(store_location: dict[str, Any]) -> None:
    """A takeover between the old writer's lease check and its manifest create lets that
    one manifest land, and nothing after; the new writer's version comes above it and is
    the newest (docs/commit-protocol.md, the takeover window)."""
    old = _open(store_location)
    old.acquire_lease()
    new = _open(store_location)

    def take_over(_name: str, _ctx: Any) -> None:
        hooks.disarm("checkpoint.before_manifest")
        new.acquire_lease(takeover=True)

    hooks.arm("checkpoint.before_manifest", take_over)
    try:
        txn = old.begin(1)
        txn.put_array("a", np.ones(2))
        assert txn.commit().version == 1  # checked before the takeover: lands
    finally:
        hooks.disarm_all()
    with pytest.raises(FencedError):
        old.begin(2)
    txn = new.begin(1, parent=None)
    txn.put_array("a", np.zeros(2))
    assert txn.commit().version == 2
    latest = new.latest()
    assert latest is not None and latest.manifest.writer["generation"] == 2
    assert [new.manifest(v).writer["generation"] for v in new.versions()] == [1, 2]
    new.release_lease()
