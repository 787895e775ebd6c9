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
from typing import Any

from cocoon_ckpt.errors import ConfigMismatchError
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.build import build_trainer, model_shapes, threat_model
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.session import open_job
from cocoon_ckpt.train.trainer import DPTrainer, StepResult

__all__ = [
    "ConfigMismatchError",
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
    *,
    storage_options: dict[str, Any] | None = None,
    builder: Callable[..., JobParts] | None = None,
    key_file: str | None = None,
    takeover: bool = False,
    allow: ResumeAllowances | None = None,
    on_step: Callable[[StepResult, DPTrainer], None] | None = None,
    on_precompute: Callable[[int, int], None] | None = None,
    stop_after: int | None = None,
    fs: Any = None,
) -> RunResult:
    """Train `config` to completion (or `stop_after` steps), checkpointing to the store.

    Args:
        config: the job.
        store_url: where its versions live (local path or fsspec URL).
        storage_options: fsspec options for the URL.
        builder: the job builder (resolved from `config.job` by default).
        key_file: keep the noise key in this file (0600) instead of the store.
        takeover: take the writer lease even if its holder looks alive.
        allow: the resume checks to lift, each at the cost its field states
            (`ResumeAllowances(fallback=True)`, ...); None lifts none.
        on_step: called after each step (progress bars).
        on_precompute: called as (rows done, rows in all) while coalesced embedding noise
            is precomputed (before step 0; a resume loads it from the store instead).
        stop_after: stop once this many steps are done (tests, benchmarks).
        fs: an fsspec filesystem to use for the store (fault injection).

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
    with open_job(
        config,
        store_url,
        builder,
        storage_options=storage_options,
        key_file=key_file,
        takeover=takeover,
        allow=allow,
        on_precompute=on_precompute,
        fs=fs,
    ) as job:
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
