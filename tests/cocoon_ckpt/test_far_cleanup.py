"""The far tier leaves nothing behind: folders of a SIGKILLed owner go at the next start-up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from cocoon_ckpt.tiers import FarTier

ROOT = Path(__file__).resolve().parents[2]

# Builds a far tier in the folder argv[1], says where its folders are, then waits for a
# line on stdin and closes it (a live owner), unless it is killed first.
_OWNER = """
import json, sys
from cocoon_ckpt.tiers.far import FarTier
far = FarTier(1 << 20, folder=sys.argv[1])
far.allocate(2, 1000, "float32")
print(json.dumps([far._dir, far._shm, far.worker_pid]), flush=True)
sys.stdin.readline()
far.close()
"""


def _owner(folder: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(folder)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _built(proc: subprocess.Popen[str]) -> tuple[list[str], int]:
    """The owner's folders and worker pid, once it has built its far tier."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"far tier owner failed to start (exit {proc.wait()})"
    *folders, worker = json.loads(line)
    return folders, worker


def test_folders_of_a_killed_owner_are_removed_at_the_next_start_up(tmp_path: Path) -> None:
    dead, live = _owner(tmp_path), _owner(tmp_path)  # both start up at once
    try:
        (dead_folders, dead_worker), (live_folders, _) = _built(dead), _built(live)
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert all(os.path.isdir(f) for f in dead_folders)  # what SIGKILL leaves
        far = FarTier(1 << 20, folder=str(tmp_path))  # the next start-up
        try:
            assert not any(os.path.exists(f) for f in dead_folders)
            assert all(os.path.isdir(f) for f in live_folders)
            assert os.path.isfile(os.path.join(live_folders[0], "history"))
            assert len(list(tmp_path.iterdir())) == 2  # the live owner's and this one's
        finally:
            far.close()
        live.communicate("close\n", timeout=30)
        assert live.returncode == 0
    finally:
        dead.kill()
        live.kill()
    assert not any(os.path.exists(f) for f in live_folders)  # closed: removed by itself
    # the dead owner's worker saw its pipe close and ended too
    deadline = time.monotonic() + 10
    while _runs(dead_worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _runs(dead_worker)


def _runs(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
