"""Coalesced noise on several ranks with `csc_window_steps`: once a version holds the
CSC's parts, each rank reads its own part from the store in windows (never whole, each
window checked) instead of holding it; a resume on the same world size opens its part
in windows at once. Real gloo processes running the `train` command: the columns each
rank applies are the one process's bit for bit, across a SIGKILL and a resume."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from .test_distributed_coalesced import _columns, _run, _train_args

_WINDOWS = re.compile(r"table (\S+): CSC part \[(\d+), (\d+)\) read in (\d+) windows of 3 steps")


def _args(store: Path, key: Path) -> list[str]:
    extra = ("--csc-window-steps", "3", "--sync-checkpoints")
    return ["--log-level", "INFO", *_train_args(store, key, *extra)]


def _windows(logs: Path, rank: int) -> dict[str, int]:
    err = Path(f"{logs}-{rank}.err").read_text()
    return {m.group(1): int(m.group(4)) for m in _WINDOWS.finditer(err)}


@pytest.mark.slow
def test_each_rank_reads_its_part_in_windows_across_a_kill_and_resume(tmp_path: Path) -> None:
    key = tmp_path / "k"
    _run(1, tmp_path / "one.zarr", key, tmp_path / "one")
    one = _columns(tmp_path / "one")

    store = tmp_path / "two.zarr"
    _run(2, store, key, tmp_path / "two", args=_args(store, key))
    for rank in range(2):
        assert _columns(tmp_path / "two", rank) == one  # the one process's bits
        # after the first version each rank read its part of every table it holds
        # in windows
        assert _windows(tmp_path / "two", rank) and all(_windows(tmp_path / "two", rank).values())

    killed = tmp_path / "killed.zarr"
    codes = _run(2, killed, key, tmp_path / "k1", "trainer.after_update:step=6", _args(killed, key))
    assert codes == [-signal.SIGKILL] * 2
    _run(2, killed, key, tmp_path / "k2", args=_args(killed, key))
    for rank in range(2):
        before, after = _columns(tmp_path / "k1", rank), _columns(tmp_path / "k2", rank)
        assert before == one[: len(before)]
        assert after == one[len(one) - len(after) :] and len(before) + len(after) > len(one)
        # the resume on 2 ranks opened its own parts in windows from the version
        assert _windows(tmp_path / "k2", rank)
