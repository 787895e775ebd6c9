"""Run a resumable private job against a store to its end: `open_job` with no loop body.

Running the same job against a store that has versions resumes from the newest valid
one, and the result is bit-identical to an uninterrupted run (I3). Every version stores
the loss of each step so far (`format.metrics`), as the session does for any loop.

A refused or failed start changes nothing: the config, the job's parts, the newest
version, the key and every resume check are settled before the first write (creating
the store, writing the key, taking the lease).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cocoon_ckpt.errors import ConfigMismatchError
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.build import build_trainer, model_shapes, threat_model
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.session import open_job
from cocoon_ckpt.train.start import Parts
from cocoon_ckpt.train.trainer import DPTrainer, StepResult

__all__ = [
    "ConfigMismatchError",
    "JobOptions",
    "ResumeAllowances",
    "RunResult",
    "build_trainer",
    "key_id",
    "model_shapes",
    "run_job",
    "threat_model",
]


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a run ended.

    Attributes:
        steps_done: Steps the job has taken, resumed ones included.
        resumed_from: Step of the version the run resumed from (None for a fresh start).
        epsilon: Epsilon spent at the end of the run, at `DPConfig.delta`.
        version: Newest committed version.
    """

    steps_done: int
    resumed_from: int | None
    epsilon: float
    version: int | None


def run_job(
    config: JobConfig,
    store_url: str,
    parts: Parts = None,
    *,
    options: JobOptions | None = None,
    on_step: Callable[[StepResult, DPTrainer], None] | None = None,
    stop_after: int | None = None,
) -> RunResult:
    """Train `config` to completion (or `stop_after` steps), checkpointing to the store.

    Args:
        config: the job (sigma given, or a target epsilon calibrated once at start).
        store_url: where its versions live (local path or fsspec URL).
        parts: the job's parts (`JobParts`), or a builder called as `builder(config)`;
            None resolves `config.job`.
        options: how it runs against its store (`JobOptions`: key file, storage,
            takeover, the resume checks lifted, precompute progress); None: defaults.
        on_step: called after each step (progress bars).
        stop_after: stop once this many steps are done (tests, benchmarks).

    Raises:
        ConfigError: `store_url` is empty.
        ConfigMismatchError: the store belongs to a job with another configuration.
        NoiseKeyError: the key is missing, does not match, or its file is readable by
            group or others.
        LeaseHeldError: another writer is running.
        CorruptVersionError: the newest version is damaged and fallback is off.
        PreemptedError: SIGTERM or SIGINT stopped the job (in the main thread of a
            single-process job: after the step in progress, a checkpoint of it and the
            lease's release).

    Every refusal comes before the first write: a refused start leaves the store (or
    its absence), the key file and the lease as they were.

    Under torchrun (or with a process group already started) every rank runs this:
    rank 0 holds the lease for the whole job, chooses the version to resume from and
    writes the manifests; each rank keeps its shard of the noise history
    (`cocoon_ckpt.train.distributed`). There the signals keep their default handlers: the
    ranks would have to agree on the step to stop at.
    """
    with open_job(config, store_url, parts, options=options) as job:
        try:
            for res in job.steps(until=stop_after):
                if on_step is not None:
                    on_step(res, job.trainer)
        except RuntimeError as exc:  # a worker's death torch raised in this loop's body
            named = job.worker_failure(exc)
            if named is None:
                raise
            raise named from exc
        last = job.wait()
        result = RunResult(
            steps_done=job.step,
            resumed_from=job.resumed_from,
            epsilon=job.epsilon(),
            version=last.version if last else None,
        )
        # every step of the cadence is saved; `stop_after` stops as a crash would
        job.close(checkpoint=False)
    return result
