"""Your own loop: open a job on a store, take its DP steps one at a time, evaluate or log
between them, stop when you like.

    with open_job(config, "runs/job.zarr", parts, options=JobOptions(key_file="noise.key")) as job:
        for step in job.steps():
            if step.step % 100 == 99:
                job.log(accuracy=evaluate(job.model))

Opening a store that has versions resumes from the newest valid one (the same checks and
refusals as `run_job`, all before the first write). Checkpoints follow the config's
cadence, in the background when `async_checkpoint`; leaving the block writes a final
version of the step reached, so a loop that stops early loses nothing. Every version
carries the job records (`train.job_records`), so `inspect`, `audit`, `diff`, `gc` and
`export_model` read it as they read `run_job`'s. `run_job` is this loop with no body.
Every version also stores the loss of each step and what the loop `log`s
(`format.metrics`), which `inspect` and the plots show.

What runs between steps is part of the job: a resume continues after the newest
version's step, so the loop's code must be the same function of the step for the result
to be bit-identical (code that draws from torch's global generator included; the
version of step t holds the generators as they are when the loop asks for step t+1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Generator, Iterator

from torch import nn

from cocoon_ckpt.errors import DataWorkerError
from cocoon_ckpt.format.metrics import MetricsError, TrainingMetrics, step_scalars
from cocoon_ckpt.records import JobRecords
from cocoon_ckpt.train.checkpoint import Checkpointer, writer_handoff
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.data import Batch
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.job_records import job_records
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.preempt import Preemption, preempted_error
from cocoon_ckpt.train.start import Parts, StartedJob, start_job
from cocoon_ckpt.train.trainer import DPTrainer, StepResult
from cocoon_ckpt.train.workers import WorkerWatch
from state import Manifest, Store

__all__ = ["JobSession", "open_job"]

log = logging.getLogger(__name__)


def open_job(
    config: JobConfig,
    store_url: str,
    parts: Parts = None,
    *,
    options: JobOptions | None = None,
) -> JobSession:
    """Start `config` on the store, or resume it from the store's newest valid version.

    Args:
        config: the job (sigma given, or a target epsilon calibrated once at start).
        store_url: where its versions live (local path or fsspec URL).
        parts: the model, optimizer, loss and data (`JobParts`), or a builder called as
            `builder(config)`; None resolves `config.job`. A resume loads the stored
            state into these parts.
        options: how it runs against its store (`JobOptions`: key file, storage,
            takeover, the resume checks lifted, precompute progress); None: defaults.

    Returns:
        The open job, holding the writer lease; close it (or use it as a context
        manager) to write the last version and release the lease.

    Raises:
        ConfigError: `store_url` is empty.
        ConfigMismatchError: the store belongs to a job with another configuration.
        NoiseKeyError: the key is missing, does not match, or its file is readable by
            group or others.
        LeaseHeldError: another writer is running.
        CorruptVersionError: the newest version is damaged and fallback is off.
        PrivacyBudgetError: no sigma reaches the config's target epsilon.
        PreemptedError: SIGTERM or SIGINT arrived while the job was being set up.

    Every refusal comes before the first write (`train.start`). In the main thread of a
    single process, SIGTERM and SIGINT are handled from here until the job closes:
    during set-up they raise at once; once open, the first is noted and the job stops
    at the next step (see `JobSession.steps`). Under torchrun every rank opens the job
    and the signals keep their default handlers (the ranks would have to agree on a
    step to stop at).
    """
    options = options or JobOptions()
    dist = DistContext.from_env()
    preempt = Preemption() if dist is None else None
    with contextlib.ExitStack() as undo:
        if preempt is not None:
            undo.enter_context(preempt)
        # the start puts the lease it takes here while a signal is held off
        # (`Preemption.holding`): from then on every way out releases it
        leased: list[Store] = []
        undo.callback(_release, leased)
        job = start_job(
            config,
            store_url,
            parts,
            options,
            dist=dist,
            leased=leased,
            hold=preempt.holding if preempt is not None else contextlib.nullcontext,
        )
        undo.callback(job.trainer.close)
        if job.version is not None:
            log.info(
                "resuming %s from version %d (step %d)",
                job.store.url,
                job.version.version,
                job.version.step,
            )
        records = job_records(job.config, job.trainer, job.key, options.key_file)
        # every rank keeps its precompute tiles (on several, in a folder of its own)
        _precompute(job.trainer, job.store, records, options.on_precompute)
        ckpt = Checkpointer(
            job.store,
            async_write=job.config.async_checkpoint,
            keep_last=job.config.keep_last,
            lent_rows=options.lent_rows,
        )
        ckpt.set_parent(job.version.manifest if job.version is not None else None)
        session = JobSession(job, ckpt, records, preempt)
        undo.pop_all()  # the session owns the lease, the trainer and the handlers now
    return session


def _release(leased: list[Store]) -> None:
    """The leases the start took, released (a failed or stopped start)."""
    for store in leased:
        store.release_lease()


def _precompute(
    trainer: DPTrainer,
    store: Store | None,
    records: JobRecords,
    on_precompute: Callable[[int, int], None] | None,
) -> None:
    """Precompute coalesced embedding noise before step 0 (a resume loaded it), each
    finished tile kept in `store` so a stopped precompute resumes (on several ranks,
    each rank's own tiles: `embedding.stored_tiles`)."""
    emb = trainer.embedding
    if emb is None or emb.prepared:
        return
    # this rank's cold slots (all of them in one process: `TableEngine.my_part`)
    total = sum(e.my_part[1] - e.my_part[0] for e in emb.engines if e.needs_precompute)
    done = [0]

    def progress(rows: int) -> None:
        done[0] += rows
        if on_precompute is not None:
            on_precompute(done[0], total)

    secs = emb.prepare(progress, store=store, job_fingerprint=records["fingerprint"])
    log.info("precomputed coalesced embedding noise in %.2f s", secs)


class JobSession:
    """An open job: its trainer, its store (writer lease held) and its checkpoints.

    Made by `open_job`; use it as a context manager. Attributes: `config`, `store`,
    `trainer` (the `DPTrainer`), `resumed_from` (the step of the version it resumed
    from, None for a fresh start), `metrics` (the `TrainingMetrics` stored so far).
    """

    def __init__(
        self,
        job: StartedJob,
        ckpt: Checkpointer,
        records: JobRecords,
        preempt: Preemption | None,
    ) -> None:
        latest, store, trainer, coordinator = job.version, job.store, job.trainer, job.coordinator
        self.config = job.config
        self.store = store
        self.trainer = trainer
        self.resumed_from = latest.step if latest is not None else None
        self.metrics = TrainingMetrics.of_version(latest, store.url)
        self._ckpt = ckpt
        self._records = records
        self._saved = latest.step if latest is not None else 0
        self._preempt = preempt
        self._coordinator = coordinator
        self._active: Generator[StepResult, None, None] | None = None
        #: the batches of the steps now running (a DataLoader worker's death is named
        #: from them: `worker_failure`)
        self._watched: WorkerWatch | None = None
        self._closed = False
        self._stopped = False  # a PreemptedError was raised for the noted signal
        # the precompute's tile parts, until a committed version holds the CSC
        self._tile_parts = coordinator and trainer.embedding is not None
        self._drop_tile_parts()
        self._defer = contextlib.ExitStack()
        if ckpt.async_write:
            self._defer.enter_context(writer_handoff())  # until close
        if preempt is not None:
            # from here to close a signal is noted and acted on between steps
            self._defer.enter_context(preempt.deferring())

    @property
    def model(self) -> nn.Module:
        """The model being trained (the one the parts gave, with any resumed state)."""
        return self.trainer.model

    @property
    def step(self) -> int:
        """Steps taken so far (resumed ones included): the next step's index."""
        return self.trainer.step_index

    @property
    def done(self) -> bool:
        """Every step of the config is taken."""
        return self.trainer.done

    def epsilon(self) -> float:
        """Epsilon spent so far, at the config's delta (a PLD composition: not free)."""
        return self.trainer.epsilon()

    def steps(self, until: int | None = None) -> Iterator[StepResult]:
        """Take the job's steps, yielding each one's result after it is taken.

        Args:
            until: stop before this step (default: the config's last step); the
                iterator then ends without writing a version (closing the job does).

        Each checkpoint of the cadence (and the last step's) is written after the loop's
        body has run for that step. A signal noted since the last step stops the job
        before the next: the step reached is checkpointed in the foreground and
        `PreemptedError` is raised (the job's `close` releases the lease). A new call
        to `steps()` ends the earlier iterator (it stops yielding).

        Raises:
            PreemptedError: SIGTERM or SIGINT was received (single process, main thread).
            RuntimeError: the job is closed.
        """
        if self._closed:
            raise RuntimeError(f"the job on {self.store.url} is closed; open it again")
        total = self.config.dp.steps
        limit = total if until is None else min(until, total)
        if self._active is not None:
            self._active.close()  # its loader (and any workers) goes now
        self._active = self._run(limit)
        return self._active

    def _run(self, limit: int) -> Generator[StepResult, None, None]:
        trainer = self.trainer
        if trainer.step_index >= limit:
            return
        batches = self._watched = self._batches(limit)
        try:
            while trainer.step_index < limit:
                self._stop_if_preempted()
                batch = self._next_batch(batches)
                with self._naming(batches):
                    res = trainer.train_step(batch)
                    self.metrics.add(res.step, step_scalars(res))
                yield res
                at_end = trainer.step_index == self.config.dp.steps
                if trainer.step_index % self.config.checkpoint_every == 0 or at_end:
                    with self._naming(batches):
                        self._save()
        finally:
            batches.close()  # the workers end with the loop, stuck ones killed

    def _batches(self, limit: int) -> WorkerWatch:
        """The batches of steps [step, limit) through the job's DataLoader (its workers
        fetch ahead while the steps run)."""
        return WorkerWatch(self.trainer.loader(limit))

    def _next_batch(self, batches: WorkerWatch) -> Batch:
        """The next step's batch; a DataLoader worker that died or stopped is named."""
        try:
            return next(batches)
        except DataWorkerError as exc:
            # no step began: a worker lost to the signal stopping the job (one started
            # before it could ignore it) ends in the checkpoint that signal asks for
            self._stop_if_preempted()
            raise self._worker_error(exc) from exc

    @contextlib.contextmanager
    def _naming(self, batches: WorkerWatch) -> Iterator[None]:
        """A worker's death that torch raises inside (from its SIGCHLD handler, wherever
        this thread is) named: the step or checkpoint it cut is lost, the newest
        committed version is kept."""
        try:
            yield
        except DataWorkerError:
            raise
        except RuntimeError as exc:
            failure = batches.failure(exc)
            if failure is None:
                raise
            raise self._worker_error(failure) from exc

    def worker_failure(self, exc: BaseException) -> DataWorkerError | None:
        """A DataLoader worker's death that torch raised in the caller's loop body
        (from its SIGCHLD handler, wherever the main thread was when it came), named as
        the job's own steps name it; None when `exc` is something else."""
        if self._watched is None or isinstance(exc, DataWorkerError):
            return None
        failure = self._watched.failure(exc)
        return None if failure is None else self._worker_error(failure)

    def _worker_error(self, exc: DataWorkerError) -> DataWorkerError:
        return DataWorkerError(
            f"{self.store.url}: {exc.what}; the job stopped, its writer lease is released "
            "and the newest committed version is kept",
            exc.fix,
            pid=exc.pid,
            step=exc.step,
        )

    def log(self, step: int | None = None, **scalars: float) -> None:
        """Store scalars (an evaluation's accuracy, a learning rate) as values of a step.

        Args:
            step: their step (default: the last taken), one taken since the newest version.
            **scalars: metric name to a finite number (a float, or a 0-d tensor).

        Raises:
            MetricsError: a name or a value is refused, the step is outside the steps
                taken since the newest version, or a metric already has a point there.
        """
        lo, hi = self._saved, self.trainer.step_index
        at = hi - 1 if step is None else step
        if not lo <= at < hi:
            raise MetricsError(
                f"metrics of step {at} cannot be stored: only steps taken since the newest "
                f"version, [{lo}, {hi}), can be; log inside the loop, after the step"
            )
        self.metrics.add(at, scalars)

    def checkpoint(self) -> None:
        """Write a version of the step reached now (in the background when async),
        unless the newest version already holds it."""
        if self._closed:
            raise RuntimeError(f"the job on {self.store.url} is closed; open it again")
        if self.trainer.step_index != self._saved:
            self._save()

    def wait(self) -> Manifest | None:
        """Block until the checkpoint in flight is committed; the newest version written
        or resumed from (None before the first). Re-raises a failed background write."""
        return self._ckpt.wait()

    def _save(self) -> None:
        step = self.trainer.step_index
        records: JobRecords = {
            **self._records,
            "complete": step == self.config.dp.steps,
            "metrics": self.metrics.to_record(step),
        }
        self._ckpt.save(self.trainer, records)
        self._saved = step
        self._drop_tile_parts()

    def _drop_tile_parts(self) -> None:
        """Delete the precompute's tile parts once a committed version holds the CSC
        (with async checkpoints: seen at the next save, or at close)."""
        emb = self.trainer.embedding
        if self._tile_parts and emb is not None:
            self._tile_parts = not emb.drop_tile_parts(self.store, self._ckpt.last)
        elif not self._coordinator and emb is not None:
            # another rank: its own CSC part is read in windows once committed
            emb.csc_committed(self.store, self._ckpt.last)

    def _stop_if_preempted(self) -> None:
        requested = self._preempt.requested if self._preempt is not None else None
        if requested is None:
            return
        # finish in the foreground: the step is done, its checkpoint committed
        if self.trainer.step_index != self._saved:
            self._save()
        self._stopped = True
        raise preempted_error(requested, self.trainer.step_index, self._ckpt.wait(), self.store.url)

    def close(self, checkpoint: bool = True) -> None:
        """Write the last version, wait for it, free the trainer, release the lease and
        restore the signal handlers. Idempotent.

        Args:
            checkpoint: write a version of the step reached if the newest is older.
                False loses the steps since the last checkpoint, as a crash would (the
                job's exit on an exception does this: a step may have stopped halfway).

        Raises:
            PreemptedError: a signal was noted after the loop's last step and the job is
                unfinished (after the checkpoint and the lease's release).
        """
        if self._closed:
            return
        self._closed = True
        if self._active is not None:
            self._active.close()
        try:
            try:
                if checkpoint and self.trainer.step_index != self._saved:
                    self._save()
            finally:
                self._ckpt.close()  # re-raises a failed background write
            self._drop_tile_parts()
        finally:
            try:
                self.trainer.close()  # frees the history's tiers (a far worker)
            finally:
                try:
                    if self._coordinator:
                        self.store.release_lease()  # even then: this process is done writing
                finally:
                    self._defer.close()
                    if self._preempt is not None:
                        self._preempt.__exit__(None, None, None)
        requested = self._preempt.requested if self._preempt is not None else None
        if checkpoint and requested is not None and not self._stopped and not self.trainer.done:
            raise preempted_error(
                requested, self.trainer.step_index, self._ckpt.last, self.store.url
            )

    def __enter__(self) -> JobSession:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(checkpoint=exc_type is None)
