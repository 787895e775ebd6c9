"""DataLoader workers under a scheduler: they ignore the signals that stop the job, and
one that dies, stops or hangs is named.

A scheduler stops a job by signalling its whole process group (SLURM's scancel,
Kubernetes, Ctrl-C at a terminal). The workers ignore SIGTERM and SIGINT from their
first instruction: they start with both blocked (fork and spawn keep the mask), and
their init sets them to SIG_IGN before the user's `worker_init_fn`, so the main process
finishes its step and checkpoints (`train.preempt`) instead of failing on their deaths.
`WorkerWatch` names a worker that died, was stopped or sent no batch within the
worker timeout (a watchdog thread), and ends the workers, which no longer die of
SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from cocoon_ckpt.errors import DataWorkerError

if TYPE_CHECKING:
    from cocoon_ckpt.train.data import Batch

__all__ = ["DEFAULT_WORKER_TIMEOUT_S", "WorkerInit", "WorkerLoader", "WorkerWatch"]

#: Seconds a step waits for its batch from a DataLoader worker before the worker is
#: named and the job stops (`JobParts.worker_timeout_s`): room for a worker's start and
#: a slow Dataset's reads, short beside a scheduler's allocation.
DEFAULT_WORKER_TIMEOUT_S = 300.0

#: What a scheduler sends the whole process group to stop a job.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class WorkerInit:
    """A DataLoader worker's start: SIGTERM and SIGINT ignored (they arrived blocked by
    `WorkerLoader`, and a signal pending since is dropped), then the user's `worker_init_fn`.
    Picklable, for workers that are not forked."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        if self.user is not None:
            self.user(worker_id)


class WorkerLoader(DataLoader[Any]):
    """A DataLoader whose workers start with SIGTERM and SIGINT blocked, so a signal to
    the process group between a worker's fork and its `WorkerInit` cannot kill it. The
    blocking thread gets a signal sent meanwhile once its mask is restored (another
    thread of the process takes it at once)."""

    def __init__(self, *args: Any, worker_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_timeout_s = worker_timeout_s
        """Seconds a step waits for its batch before `WorkerWatch` names the worker."""

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            return super()._get_iterator()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _proc_state(pid: int) -> str | None:
    """The kernel's one-letter state of a live process (`T`: stopped), None where
    /proc does not say (another OS, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # pid (comm) S ...: comm may hold spaces and parentheses, the state follows the last ')'
    rest = stat[stat.rfind(")") + 1 :].split()
    return rest[0] if rest else None


class WorkerWatch:
    """A loader's batches with its workers watched.

    A worker that died is named at once (torch reports its death); one that was stopped
    or is stuck is named once a step has waited `timeout_s` for its batch: a watchdog
    thread kills the loader's workers then, since the main thread may be blocked where
    no timeout reaches (reading a tensor's file descriptor from the stopped worker). The
    error, `DataWorkerError`, names the worker's pid, what happened and what to do, and
    every worker is ended before it is raised (the workers ignore SIGTERM: a stopped or
    stuck one would outlive the job, and the interpreter's exit would wait for it).
    `close` ends them in any case.

    Args:
        loader: a `make_loader` loader; its `worker_timeout_s` is the seconds a step
            waits for its batch (`JobParts.worker_timeout_s`; the default for another).
    """

    def __init__(self, loader: DataLoader[Any]) -> None:
        # a PoissonBatchSampler's first step (train.data imports this module)
        self.step = int(getattr(loader.batch_sampler, "start", 0))
        """The step whose batch comes next."""
        self._timeout = float(getattr(loader, "worker_timeout_s", DEFAULT_WORKER_TIMEOUT_S))
        self._expired: DataWorkerError | None = None
        self._it: Iterator[Any] = iter(loader)
        self._workers: list[Any] = list(getattr(self._it, "_workers", ()))
        # One watchdog thread for the loader, polling a deadline the main thread sets
        # and clears around each fetch: a thread started and joined per batch cost
        # ~1.5 ms a batch on a busy 2-core machine (the fetch itself: ~1.7 ms).
        self._deadline: float | None = None
        self._lock = threading.Lock()  # held while the watchdog names and kills
        self._closed = threading.Event()
        if self._workers:
            threading.Thread(target=self._watch, name="cocoon-worker-watch", daemon=True).start()

    def __iter__(self) -> WorkerWatch:
        return self

    def __next__(self) -> Batch:
        if not self._workers:
            return self._next()
        self._deadline = time.monotonic() + self._timeout
        try:
            batch = self._next()
        except DataWorkerError:
            raise
        except Exception as exc:
            self._disarm()
            if self._expired is None:
                raise
            self._reap()
            raise self._expired from exc
        finally:
            self._disarm()
        if self._expired is not None:  # it fired as the batch came: its kill stands
            self._reap()
            raise self._expired
        return batch

    def _disarm(self) -> None:
        """No deadline; once the watchdog is done naming and killing, if it began."""
        self._deadline = None
        with self._lock:
            pass

    def _watch(self) -> None:
        poll = min(1.0, self._timeout / 4)
        while not self._closed.wait(poll):
            deadline = self._deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            with self._lock:
                if self._deadline is None:  # the batch came meanwhile
                    continue
                self._expire()
            return

    def _next(self) -> Batch:
        try:
            batch: Batch = next(self._it)
        except RuntimeError as exc:
            failure = self.failure(exc) if self._expired is None else None
            if failure is None:
                raise
            raise failure from exc
        self.step = batch.step + 1
        return batch

    def failure(self, exc: BaseException) -> DataWorkerError | None:
        """The dead worker behind `exc` (torch's report of a worker's death, raised
        wherever this thread was), named, with every worker ended; None when no worker
        died (`exc` is a Dataset's own error)."""
        named = self._dead()
        if named is not None:
            self._kill()
            self._reap()
        return named

    def _dead(self) -> DataWorkerError | None:
        # The worker to name: one killed by a signal, else one that failed, else one
        # that exited 0. Once one dies, torch's loader may shut the others down, and a
        # sibling then exits 0 before this looks: naming the first by index named that
        # sibling (seen once under load, in test_preempt_group's SIGKILL test).
        exited = [(wid, w) for wid, w in enumerate(self._workers) if w.exitcode is not None]
        if not exited:
            return None
        wid, w = min(
            exited, key=lambda item: 0 if item[1].exitcode < 0 else 1 if item[1].exitcode else 2
        )
        code = w.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code < 0 and -code in signal.valid_signals()
            else f"exited with code {code}"
        )
        return DataWorkerError(
            f"DataLoader worker {wid} (pid {w.pid}) {how} (step {self.step} was next)",
            "if it ran out of memory, give the job more or fewer workers "
            "(JobParts.num_workers); rerun the same command to resume",
            pid=int(w.pid),
            step=self.step,
        )

    def _expire(self) -> None:
        """The watchdog: the step waited `timeout_s`; the worker named, all killed (the
        blocked main thread then gets an error and raises the named one)."""
        self._expired = self._stuck()
        self._kill()

    def _stuck(self) -> DataWorkerError:
        info = getattr(self._it, "_task_info", {}).get(getattr(self._it, "_rcvd_idx", -1))
        awaited = int(info[0]) if info else 0
        waited = f"step {self.step} waited {self._timeout:g} s for its batch"
        order = sorted(range(len(self._workers)), key=lambda wid: wid != awaited)
        for wid in order:
            pid = int(self._workers[wid].pid)
            if _proc_state(pid) in ("T", "t"):
                return DataWorkerError(
                    f"DataLoader worker {wid} (pid {pid}) is stopped (SIGSTOP, or a "
                    f"debugger) and {waited}",
                    "find what stopped it; rerun the same command to resume",
                    pid=pid,
                    step=self.step,
                )
        pid = int(self._workers[awaited].pid)
        return DataWorkerError(
            f"DataLoader worker {awaited} (pid {pid}) sent no batch: {waited} "
            "(JobParts.worker_timeout_s)",
            "if the Dataset reads that slowly, raise JobParts.worker_timeout_s; else see "
            f"where it waits (py-spy dump --pid {pid}); rerun the same command to resume",
            pid=pid,
            step=self.step,
        )

    def _kill(self) -> None:
        """Every worker SIGKILLed (a stopped one too), their deaths not reported by
        torch's SIGCHLD handler (it would raise them in the main thread, wherever it is:
        these deaths are ours)."""
        it = self._it
        if getattr(it, "_worker_pids_set", False):
            torch._C._remove_worker_pids(id(it))
            it._worker_pids_set = False  # type: ignore[attr-defined]
        for w in self._workers:
            if w.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGKILL)

    def _reap(self) -> None:
        """The killed workers joined, the loader shut down."""
        for w in self._workers:
            w.join()
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    def close(self) -> None:
        """End the workers: asked to leave, and killed where they do not (stopped, or
        stuck in a fetch: torch would wait 10 s for each, then the exit forever)."""
        self._closed.set()
        workers = self._workers
        if any(w.exitcode is None and _proc_state(int(w.pid)) in ("T", "t") for w in workers):
            self._kill()
        self._reap_leftovers()

    def _reap_leftovers(self) -> None:
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        if any(w.exitcode is None for w in self._workers):
            self._kill()
            self._reap()
