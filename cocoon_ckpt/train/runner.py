"""Run a resumable private job against a store; export its final model.

Running the same job against a store that has versions resumes from the newest valid
one, and the result is bit-identical to an uninterrupted run (I3).

A refused or failed start changes nothing: the config, the job's parts, the newest
version, the key and every resume check are settled before the first write (creating
the store, writing the key, taking the lease).
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.errors import ConfigMismatchError, PreemptedError
from cocoon_ckpt.keys import key_id, key_location, load_key
from cocoon_ckpt.records import JobRecords
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.build import build_trainer, model_shapes, threat_model
from cocoon_ckpt.train.checkpoint import Checkpointer
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.preempt import Preemption
from cocoon_ckpt.train.resume import prepare_trainer
from cocoon_ckpt.train.start import failure_to_ranks, start_job
from cocoon_ckpt.train.stored import read_config
from cocoon_ckpt.train.trainer import DPTrainer, StepResult
from state import Manifest, Store, StoreError

__all__ = [
    "ConfigMismatchError",
    "RunResult",
    "build_trainer",
    "key_id",
    "model_shapes",
    "read_config",
    "run_job",
    "threat_model",
]

log = logging.getLogger("cocoon_ckpt.train.runner")


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a run ended."""

    steps_done: int
    resumed_from: int | None
    """Step of the version the run resumed from (None for a fresh start)."""
    epsilon: float
    version: int | None
    """Newest committed version."""


def run_job(
    config: JobConfig,
    store_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    builder: Callable[..., JobParts] | None = None,
    key_file: str | None = None,
    takeover: bool = False,
    allow_fallback: bool = False,
    allow_generator_change: bool = False,
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
        allow_fallback: resume from an older version if the newest is damaged.
        allow_generator_change: resume although the generator backend differs (I3 lost).
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
    valid.text("store_url", store_url)
    dist = DistContext.from_env()
    preempt = Preemption() if dist is None else None
    with preempt if preempt is not None else contextlib.nullcontext():
        return _run(
            config,
            store_url,
            dist=dist,
            preempt=preempt,
            storage_options=storage_options,
            builder=builder,
            key_file=key_file,
            takeover=takeover,
            allow_fallback=allow_fallback,
            allow_generator_change=allow_generator_change,
            on_step=on_step,
            on_precompute=on_precompute,
            stop_after=stop_after,
            fs=fs,
        )


def _run(
    config: JobConfig,
    store_url: str,
    *,
    dist: DistContext | None,
    preempt: Preemption | None,
    storage_options: dict[str, Any] | None,
    builder: Callable[..., JobParts] | None,
    key_file: str | None,
    takeover: bool,
    allow_fallback: bool,
    allow_generator_change: bool,
    on_step: Callable[[StepResult, DPTrainer], None] | None,
    on_precompute: Callable[[int, int], None] | None,
    stop_after: int | None,
    fs: Any,
) -> RunResult:
    coordinator = dist is None or dist.is_coordinator
    trainer: DPTrainer | None = None
    if dist is not None and not dist.is_coordinator:
        # wait for the coordinator's lease, key and choice of version
        status, payload = dist.broadcast_object(None)
        if status == "error":
            raise StoreError(f"rank 0 could not start the job: {payload}")
        store = Store.open(store_url, storage_options=storage_options, fs=fs, create=False)
        latest = store.read(payload) if payload is not None else None
        key = load_key(store, key_file)
    else:
        with failure_to_ranks(dist):
            store, latest, key, trainer = start_job(
                config,
                store_url,
                storage_options=storage_options,
                fs=fs,
                builder=builder,
                key_file=key_file,
                takeover=takeover,
                allow_fallback=allow_fallback,
                allow_generator_change=allow_generator_change,
                dist=dist,
            )
        if dist is not None:
            dist.broadcast_object(("ok", latest.version if latest else None))
    ckpt: Checkpointer | None = None
    try:
        if trainer is None:
            # In a multi-process job every rank builds its trainer after rank 0's start
            # (a user's builder may hold collectives), then checks and restores it.
            resume = (store, latest) if latest is not None else None
            trainer = prepare_trainer(config, key, builder, dist, allow_generator_change, resume)
        if latest is not None:
            log.info(
                "resuming %s from version %d (step %d)", store.url, latest.version, latest.step
            )
        emb = trainer.embedding
        if emb is not None and not emb.prepared:
            total = sum(e.rows - e.plan.hot for e in emb.engines if e.needs_precompute)
            done = [0]

            def progress(rows: int) -> None:
                done[0] += rows
                if on_precompute is not None:
                    on_precompute(done[0], total)

            secs = emb.prepare(progress)
            log.info("precomputed coalesced embedding noise in %.2f s", secs)
        ckpt = Checkpointer(store, async_write=config.async_checkpoint, keep_last=config.keep_last)
        ckpt.set_parent(latest.manifest if latest else None)
        record = config.to_record()
        shapes = model_shapes(trainer)
        job_records: JobRecords = {
            "config": record,
            "fingerprint": cfgmod.fingerprint(record, shapes),
            "model_shapes": shapes,
            "key_id": key_id(key),
            "key_location": key_location(key_file),
            "threat_model": threat_model(config),
            "complete": False,
        }
        limit = config.dp.steps if stop_after is None else min(stop_after, config.dp.steps)
        saved = latest.step if latest is not None else 0
        with preempt.deferring() if preempt is not None else contextlib.nullcontext():
            while trainer.step_index < limit:
                if preempt is not None and preempt.requested is not None:
                    break
                res = trainer.train_step()
                if on_step is not None:
                    on_step(res, trainer)
                at_end = trainer.step_index == config.dp.steps
                if trainer.step_index % config.checkpoint_every == 0 or at_end:
                    job_records["complete"] = at_end
                    ckpt.save(trainer, job_records)
                    saved = trainer.step_index
            if preempt is not None and preempt.requested is not None and trainer.step_index < limit:
                # finish in the foreground: the step is done, its checkpoint committed
                if trainer.step_index != saved:
                    job_records["complete"] = False
                    ckpt.save(trainer, job_records)
                last = ckpt.wait()
                raise _preempted(preempt.requested, trainer.step_index, last, store.url)
            last = ckpt.wait()
        return RunResult(
            steps_done=trainer.step_index,
            resumed_from=latest.step if latest is not None else None,
            epsilon=trainer.epsilon(),
            version=last.version if last else None,
        )
    finally:
        try:
            if ckpt is not None:
                ckpt.close()  # re-raises a failed background write
        finally:
            try:
                if trainer is not None:
                    trainer.close()  # frees the history's tiers (a far worker)
            finally:
                if coordinator:
                    store.release_lease()  # even then: this process is done writing


def _preempted(signum: int, step: int, last: Manifest | None, url: str) -> PreemptedError:
    name = signal.Signals(signum).name
    where = f"version {last.version} holds step {step}" if last is not None else "no version"
    return PreemptedError(
        f"stopped by {name} after step {step}; {where} in {url} and the writer lease is "
        "released: rerun the same command to resume",
        signum=signum,
        step=step,
        version=last.version if last is not None else None,
    )
