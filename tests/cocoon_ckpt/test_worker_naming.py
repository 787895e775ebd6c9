"""Which DataLoader worker a job names when several have exited: the one a signal
killed, else one that failed, else one that exited 0. Once one worker dies, torch's
loader may shut its siblings down, and a sibling can exit 0 before the job looks:
test_preempt_group's SIGKILL test once saw the job name worker 0 ("exited with code
0") for worker 1's SIGKILL. The real kill is tested there; this pins the choice."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from cocoon_ckpt.train.workers import WorkerWatch


@dataclass
class _Worker:
    pid: int
    exitcode: int | None


def _named(codes: list[int | None]) -> str | None:
    watch = object.__new__(WorkerWatch)  # only the workers and the step are read
    watch._workers = [_Worker(100 + i, c) for i, c in enumerate(codes)]
    watch.step = 5
    err = watch._dead()
    return None if err is None else str(err)


@pytest.mark.parametrize("order", list(itertools.permutations([0, -9, 1, None])))
def test_the_worker_a_signal_killed_is_named_before_one_that_exited(
    order: tuple[int | None, ...],
) -> None:
    text = _named(list(order))
    pid = 100 + order.index(-9)
    assert text is not None and f"(pid {pid}) was killed by SIGKILL" in text, text
    assert "step 5 was next" in text


def test_a_failed_worker_is_named_before_one_that_exited_0_and_none_when_all_run() -> None:
    text = _named([0, 3])
    assert text is not None and "(pid 101) exited with code 3" in text, text
    text = _named([None, 0])
    assert text is not None and "(pid 101) exited with code 0" in text, text
    assert _named([None, None]) is None
