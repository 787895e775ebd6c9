"""The process entry leaves a torch.distributed process by os._exit once its output is
flushed (gloo's threads aborted ranks in the interpreter's teardown), and any other
process by sys.exit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import atexit, sys
import torch.distributed as dist
if sys.argv[1] == "group":
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
atexit.register(lambda: print("teardown ran", flush=True))
sys.argv = ["cocoon-ckpt", "inspect", sys.argv[2] + ".missing"]
print("before", flush=True)
from cocoon_ckpt._cli.main import entry
entry()
"""


def _run(mode: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT, mode, str(tmp_path / "rendezvous")],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_rank_leaves_without_the_interpreters_teardown(tmp_path: Path) -> None:
    done = _run("group", tmp_path)
    assert done.returncode == 2, done.stderr  # inspect of a missing store: usage error
    assert "cocoon-ckpt: error:" in done.stderr  # flushed before leaving
    assert done.stdout.splitlines() == ["before"]  # no teardown


def test_a_single_process_exits_normally(tmp_path: Path) -> None:
    done = _run("single", tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == ["before", "teardown ran"]
