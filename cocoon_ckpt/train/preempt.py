"""Preemption: SIGTERM (Kubernetes, spot, SLURM) and SIGINT end a job cleanly.

While a job trains, the first signal is only noted: the step in progress finishes, the
runner writes a checkpoint in the foreground, releases the lease and raises
`PreemptedError` (the CLI exits 128 + signal: 143, 130). Outside the training loop
(setting up, precomputing) and on a second signal there is nothing to finish, so the
signal raises at once; the runner's cleanup still releases the lease. Taking the lease
is held whole (`holding`): a signal there is raised once the lease is on record for
release.

Schedulers signal the whole process group (SLURM's scancel, Kubernetes, Ctrl-C): the
DataLoader workers ignore the signal (`train.workers`), and once a signal is noted,
SIGCHLD goes back to its default until the job ends, so a worker that died of it
anyway (started before it could ignore it) is not raised by torch's SIGCHLD handler in
the middle of the step being finished or its checkpoint; no batch is fetched after.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

from cocoon_ckpt.errors import PreemptedError

if TYPE_CHECKING:
    from state import Manifest

__all__ = ["SIGNALS", "Preemption", "exit_code", "preempted_error"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by `signum` (143 for SIGTERM)."""
    return 128 + signum


class Preemption:
    """Handlers for SIGTERM and SIGINT while a job runs (main thread only; elsewhere the
    signals keep their handlers and `requested` stays None).

    Use as a context manager; inside, `deferring()` marks the stretch where a signal is
    only noted (`requested` holds its number) instead of raising.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self._defer = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            # None: a handler installed from C, which Python cannot reinstall
            signal.signal(sig, signal.SIG_DFL if old is None else old)
        self._old.clear()

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Within this block a first signal is noted, not raised."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within this block a first signal is noted; leaving it without an error, a
        noted signal raises `PreemptedError` (for a stretch of set-up that must not be
        cut in two: taking the lease and putting it on record for release)."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
        if self.requested is not None:
            raise _early(self.requested)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._defer and self.requested is None:
            self.requested = signum
            if hasattr(signal, "SIGCHLD") and signal.SIGCHLD not in self._old:
                # restored by __exit__; torch's handler would raise a worker's death here
                self._old[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return
        raise _early(signum)


def _early(signum: int) -> PreemptedError:
    """The error of a signal that stops a job before a checkpoint could be written."""
    name = signal.Signals(signum).name
    return PreemptedError(
        f"stopped by {name} before a checkpoint could be written; the newest committed "
        "version is intact: rerun the same command to resume from it",
        signum=signum,
        step=None,
        version=None,
    )


def preempted_error(signum: int, step: int, last: Manifest | None, url: str) -> PreemptedError:
    """The error a preempted job raises: which signal, the step and the version holding it."""
    name = signal.Signals(signum).name
    where = f"version {last.version} holds step {step}" if last is not None else "no version"
    return PreemptedError(
        f"stopped by {name} after step {step}; {where} in {url} and the writer lease is "
        "released: rerun the same command to resume",
        signum=signum,
        step=step,
        version=last.version if last is not None else None,
    )
