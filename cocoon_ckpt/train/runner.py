"""Run a resumable private job against a store; export its final model.

Running the same job against a store that has versions resumes from the newest valid
one, and the result is bit-identical to an uninterrupted run (I3).

A refused or failed start changes nothing: the config, the job's parts, the newest
version, the key and every resume check are settled before the first write (creating
the store, writing the key, taking the lease).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.dp.noise import check_generator_backend
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.errors import ConfigMismatchError, NoiseKeyError, PreemptedError
from cocoon_ckpt.keys import key_id, key_location, load_key, new_key, read_key_file, save_key
from cocoon_ckpt.layout import KEY_SECRET, THREAT_MODEL_DEFAULT
from cocoon_ckpt.tools.export import export_model, read_config
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.checkpoint import Checkpointer, restore_trainer_state, stored_table_plans
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.parts import JobParts, resolve
from cocoon_ckpt.train.preempt import Preemption
from cocoon_ckpt.train.trainer import DPTrainer, StepResult
from state import CorruptVersionError, Manifest, Store, StoreError, StoreNotFoundError, Version
from state.manifest import manifest_path

__all__ = [
    "ConfigMismatchError",
    "RunResult",
    "build_trainer",
    "export_model",
    "threat_model",
    "key_id",
    "read_config",
    "run_job",
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


def build_trainer(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | None = None,
    table_plans: dict[str, TablePlan] | None = None,
    dist: DistContext | None = None,
) -> DPTrainer:
    """The trainer of a job (`table_plans`: the embedding plans a resume must keep).

    Raises:
        ValueError: the builder does not take (config) or does not return JobParts.
    """
    build = builder or resolve(config.job)
    try:
        parts = build(config)
    except TypeError as exc:
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            # raised by the call itself, not inside the builder: a wrong signature
            raise ValueError(
                f"job {config.job!r}: the builder must be a function of one argument, the "
                f"JobConfig, returning JobParts ({exc})"
            ) from None
        raise
    if not isinstance(parts, JobParts):
        raise ValueError(
            f"job {config.job!r}: the builder returned {type(parts).__name__}, not JobParts"
        )
    emb = config.embedding
    if emb is not None and not emb.tables:
        emb = dataclasses.replace(emb, tables=tuple(parts.tables))
    return DPTrainer(
        parts.model,
        parts.optimizer,
        parts.loss_fn,
        parts.data,
        config.dp,
        key,
        tiers=config.tiers,
        embedding=emb,
        table_plans=table_plans,
        dist=dist,
        overlap_noise=config.overlap_noise,
    )


def threat_model(config: JobConfig) -> str:
    """The threat model a job's versions carry (`layout.THREAT_MODELS`)."""
    return config.embedding.threat_model if config.embedding else THREAT_MODEL_DEFAULT


def model_shapes(trainer: DPTrainer) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in trainer.model.state_dict().items()}


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
        with _failure_to_ranks(dist):
            store, latest, key, trainer = _start(
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
            trainer = _prepare(config, key, builder, dist, allow_generator_change, resume)
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
        extra = {
            "config": record,
            "fingerprint": cfgmod.fingerprint(record, shapes),
            "model_shapes": shapes,
            "key_id": key_id(key),
            "key_location": key_location(key_file),
            "threat_model": threat_model(config),
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
                    ckpt.save(trainer, {**extra, "complete": at_end})
                    saved = trainer.step_index
            if preempt is not None and preempt.requested is not None and trainer.step_index < limit:
                # finish in the foreground: the step is done, its checkpoint committed
                if trainer.step_index != saved:
                    ckpt.save(trainer, {**extra, "complete": False})
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


def _open_existing(url: str, storage_options: dict[str, Any] | None, fs: Any) -> Store | None:
    """The store at `url`, or None where there is none yet (nothing is created)."""
    try:
        return Store.open(url, storage_options=storage_options, fs=fs, create=False)
    except StoreNotFoundError:
        return None


def _start(
    config: JobConfig,
    store_url: str,
    *,
    storage_options: dict[str, Any] | None,
    fs: Any,
    builder: Callable[..., JobParts] | None,
    key_file: str | None,
    takeover: bool,
    allow_fallback: bool,
    allow_generator_change: bool,
    dist: DistContext | None,
) -> tuple[Store, Version | None, bytes, DPTrainer | None]:
    """Check everything, then write for the first time: create the store, take the lease,
    keep a new job's key. Returns the store (lease held), the version to resume from, the
    key, and (single process) the trainer, built, checked and restored.

    A writer that commits between the checks and the lease (possible with `takeover`)
    is caught: the checks run again, lease held, against its version."""
    store = _open_existing(store_url, storage_options, fs)
    try:
        for _ in range(2):
            seen = store.versions() if store is not None else []
            latest = store.latest(allow_fallback=allow_fallback) if store and seen else None
            resume = (store, latest) if store is not None and latest is not None else None
            key = _job_key(store, key_file, resuming=resume is not None)
            trainer = None
            if dist is None:
                trainer = _prepare(config, key, builder, None, allow_generator_change, resume)
            elif resume is not None:
                _check_records(*resume, config.to_record(), None, key, allow_generator_change)
            try:
                if store is None:
                    store = Store.open(store_url, storage_options=storage_options, fs=fs)
                if store.lease is None:
                    store.acquire_lease(takeover=takeover, expiry_s=config.lease_expiry_s)
                if store.versions()[-1:] == seen[-1:]:
                    if latest is None:
                        save_key(store, key_file, key)
                    return store, latest, key, trainer
            except BaseException:
                if trainer is not None:
                    trainer.close()
                raise
            if trainer is not None:
                trainer.close()
            log.warning("%s: another writer committed while this job started", store.url)
        raise StoreError(
            f"{store_url}: other writers kept committing while this job started; stop them, "
            "then rerun"
        )
    except BaseException:
        if store is not None:
            store.release_lease()
        raise


def _job_key(store: Store | None, key_file: str | None, *, resuming: bool) -> bytes:
    """The job's key, read but not yet written: a resume's own key, the key a fresh job
    finds (a key file of the user's, or a store whose first run died before its first
    commit), or a new one that `save_key` keeps once every check has passed."""
    if key_file is not None:
        if resuming or os.path.lexists(key_file):
            return read_key_file(key_file)
        return new_key()
    if store is not None and (resuming or store.get_secret(KEY_SECRET) is not None):
        return load_key(store, None)
    return new_key()


def _prepare(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | None,
    dist: DistContext | None,
    allow_generator_change: bool,
    resume: tuple[Store, Version] | None,
) -> DPTrainer:
    """The job's trainer; with `resume` = (store, version), checked against the version
    and restored from it."""
    plans = None
    if resume is not None:
        try:
            plans = stored_table_plans(resume[1])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise _malformed(*resume, exc) from None
    trainer = build_trainer(config, key, builder, plans, dist)
    try:
        if resume is not None:
            store, latest = resume
            shapes = model_shapes(trainer)
            _check_records(store, latest, config.to_record(), shapes, key, allow_generator_change)
            if latest.records.get("mechanism") != trainer.mechanism.state_dict():
                raise ConfigMismatchError(
                    f"{store.url}: the band coefficients computed now differ from version "
                    f"{latest.version}'s; resuming would add different noise",
                    ["mechanism.coefficients"],
                )
            try:
                restore_trainer_state(trainer, latest)
            except (KeyError, TypeError, IndexError, AttributeError) as exc:
                raise _malformed(store, latest, exc) from None
            step = trainer.step_index
            if type(step) is not int or step != latest.step or not 0 < step <= config.dp.steps:
                raise _malformed(
                    store,
                    latest,
                    ValueError(
                        f"trainer.step={step!r}, the manifest says step {latest.step} of "
                        f"{config.dp.steps}"
                    ),
                )
    except BaseException:
        trainer.close()
        raise
    return trainer


def _malformed(store: Store, latest: Version, exc: BaseException) -> CorruptVersionError:
    v = latest.version
    return CorruptVersionError(
        f"version {v} of {store.url}: a record is malformed ({type(exc).__name__}: {exc}); "
        "it cannot be resumed. Start a new store, or remove this version and resume from "
        "an older one",
        version=v,
        path=manifest_path(v),
    )


@contextlib.contextmanager
def _failure_to_ranks(dist: DistContext | None) -> Iterator[None]:
    """On the coordinator: a start-up failure is broadcast before it is raised, so the
    other ranks, waiting for the lease, key and version, raise it too instead of hanging."""
    try:
        yield
    except BaseException as exc:
        if dist is not None:
            dist.broadcast_object(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _check_records(
    store: Store,
    latest: Version,
    record: dict[str, Any],
    shapes: dict[str, list[int]] | None,
    key: bytes,
    allow_generator_change: bool,
) -> None:
    """The resume checks that need no trainer: config (and model shapes when given),
    key, generator backend."""
    rec = latest.records
    try:
        stored_cfg, stored_shapes, generator = rec["config"], rec["model_shapes"], rec["generator"]
        cfgmod.check_resume(
            stored_cfg,
            record,
            stored_shapes,
            stored_shapes if shapes is None else shapes,
            f"{store.url} (version {latest.version})",
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise _malformed(store, latest, exc) from None
    if rec.get("key_id") != key_id(key):
        raise NoiseKeyError(
            f"{store.url}: the noise key given does not match the key of version "
            f"{latest.version}; resuming would add unrelated noise. Use the job's own key"
        )
    check_generator_backend(generator, allow_change=allow_generator_change)
