"""Run a resumable private job against a store; export its final model.

Running the same job against a store that has versions resumes from the newest valid
one, and the result is bit-identical to an uninterrupted run (I3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from state import Store, StoreError, Version

from . import config as cfgmod
from .checkpoint import Checkpointer, model_state, restore_trainer_state, stored_table_plans
from .config import JobConfig
from .distributed import DistContext
from .embedding.engine import TablePlan
from .errors import ConfigMismatchError, NoiseKeyError
from .jobs import JobParts, resolve
from .layout import KEY_SECRET, THREAT_MODEL_DEFAULT
from .noise import check_generator_backend
from .trainer import DPTrainer, StepResult

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

log = logging.getLogger("cocoon_ckpt.job")


def key_id(key: bytes) -> str:
    """A public id of the noise key (keyed hash): tells keys apart, reveals nothing."""
    return hashlib.blake2b(b"cocoon-key-id", key=key, digest_size=8).hexdigest()


def _load_key(store: Store, key_file: str | None, *, create: bool) -> bytes:
    if key_file is not None:
        if os.path.exists(key_file):
            with open(key_file, "rb") as f:
                key = f.read()
            if len(key) != 32:
                raise NoiseKeyError(f"key file {key_file} holds {len(key)} bytes, not 32")
            return key
        if not create:
            raise NoiseKeyError(f"key file {key_file} does not exist; name the job's key file")
        key = secrets.token_bytes(32)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        return key
    key = store.get_secret(KEY_SECRET)
    if key is None:
        if not create:
            raise NoiseKeyError(
                f"{store.url} has no noise key (secret/{KEY_SECRET}); it was kept in a key "
                "file: pass --key-file / key_file="
            )
        key = secrets.token_bytes(32)
        store.put_secret(KEY_SECRET, key)
    return key


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
    """The trainer of a job (`table_plans`: the embedding plans a resume must keep)."""
    parts = (builder or resolve(config.job))(config)
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
        ConfigMismatchError: the store belongs to a job with another configuration.
        LeaseHeldError: another writer is running.
        CorruptVersionError: the newest version is damaged and fallback is off.

    Under torchrun (or with a process group already started) every rank runs this:
    rank 0 holds the lease for the whole job, chooses the version to resume from and
    writes the manifests; each rank keeps its shard of the noise history
    (`cocoon_ckpt.distributed`).
    """
    dist = DistContext.from_env()
    if dist is not None and not dist.is_coordinator:
        # wait for the coordinator's lease, key and choice of version
        status, payload = dist.broadcast_object(None)
        if status == "error":
            raise StoreError(f"rank 0 could not start the job: {payload}")
        store = Store.open(store_url, storage_options=storage_options, fs=fs, create=False)
    else:
        with _failure_to_ranks(dist):
            store = Store.open(store_url, storage_options=storage_options, fs=fs)
            if store.versions():
                # A resume whose key is missing is refused before the lease is taken: a
                # refused resume leaves the store exactly as it was.
                _load_key(store, key_file, create=False)
            store.acquire_lease(takeover=takeover)
    ckpt: Checkpointer | None = None
    trainer: DPTrainer | None = None
    try:
        if dist is None or dist.is_coordinator:
            with _failure_to_ranks(dist):
                latest = store.latest(allow_fallback=allow_fallback)
                key = _load_key(store, key_file, create=latest is None)
            if dist is not None:
                dist.broadcast_object(("ok", latest.version if latest else None))
        else:
            latest = store.read(payload) if payload is not None else None
            key = _load_key(store, key_file, create=False)
        plans = stored_table_plans(latest) if latest is not None else None
        trainer = build_trainer(config, key, builder, plans, dist)
        shapes = model_shapes(trainer)
        record = config.to_record()
        fp = cfgmod.fingerprint(record, shapes)
        resumed_from = None
        if latest is not None:
            _check_compatible(
                store,
                latest,
                record,
                shapes,
                trainer.mechanism.state_dict(),
                key,
                allow_generator_change,
            )
            restore_trainer_state(trainer, latest)
            resumed_from = latest.step
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
        extra = {
            "config": record,
            "fingerprint": fp,
            "model_shapes": shapes,
            "key_id": key_id(key),
            "key_location": "key_file" if key_file else f"store:secret/{KEY_SECRET}",
            "threat_model": threat_model(config),
        }
        limit = config.dp.steps if stop_after is None else min(stop_after, config.dp.steps)
        while trainer.step_index < limit:
            res = trainer.train_step()
            if on_step is not None:
                on_step(res, trainer)
            at_end = trainer.step_index == config.dp.steps
            if trainer.step_index % config.checkpoint_every == 0 or at_end:
                ckpt.save(trainer, {**extra, "complete": at_end})
        last = ckpt.wait()
        return RunResult(
            steps_done=trainer.step_index,
            resumed_from=resumed_from,
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
                if dist is None or dist.is_coordinator:
                    store.release_lease()  # even then: this process is done writing


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


def _check_compatible(
    store: Store,
    latest: Version,
    record: dict[str, Any],
    shapes: dict[str, list[int]],
    mechanism: dict[str, Any],
    key: bytes,
    allow_generator_change: bool,
) -> None:
    rec = latest.records
    cfgmod.check_resume(
        rec["config"],
        record,
        rec["model_shapes"],
        shapes,
        f"{store.url} (version {latest.version})",
    )
    if rec.get("key_id") != key_id(key):
        raise NoiseKeyError(
            f"{store.url}: the noise key given does not match the key of version "
            f"{latest.version}; resuming would add unrelated noise. Use the job's own key"
        )
    if rec["mechanism"] != mechanism:
        raise ConfigMismatchError(
            f"{store.url}: the band coefficients computed now differ from version "
            f"{latest.version}'s; resuming would add different noise",
            ["mechanism.coefficients"],
        )
    check_generator_backend(rec["generator"], allow_change=allow_generator_change)


def export_model(
    store_url: str,
    out: str,
    *,
    storage_options: dict[str, Any] | None = None,
    allow_incomplete: bool = False,
) -> dict[str, Any]:
    """Write the final model's state_dict (no noise state) and a privacy report beside it.

    Returns:
        The privacy report (also written to `<out>.privacy.json`).

    Raises:
        StoreError: the store has no version, or the job is not complete.
    """
    store = Store.open(store_url, storage_options=storage_options, create=False)
    latest = store.latest()
    if latest is None:
        raise StoreError(f"{store_url} has no committed version to export; run the job first")
    rec = latest.records
    if not rec.get("complete") and not allow_incomplete:
        raise StoreError(
            f"{store_url}: the job is at step {latest.step} of {rec['config']['dp']['steps']}; "
            "export needs a complete job (finish it, or pass allow_incomplete=True)"
        )
    tm = rec.get("threat_model", THREAT_MODEL_DEFAULT)
    if tm == "final_model" and not rec.get("complete"):
        raise StoreError(
            f"{store_url}: threat model final_model and the job is at step {latest.step}: "
            "cold embedding rows of an unfinished job lack their pending noise, so this "
            "model must not be released. Finish the job, then export"
        )
    torch.save(model_state(latest), out)
    dp = rec["config"]["dp"]
    report = {
        "epsilon": rec["accountant"]["epsilon"],
        "delta": dp["delta"],
        "mechanism": rec["mechanism"]["mechanism"],
        "bands": dp["bands"],
        "steps": latest.step,
        "noise_multiplier": dp["noise_multiplier"],
        "max_grad_norm": dp["max_grad_norm"],
        "threat_model": rec.get("threat_model", THREAT_MODEL_DEFAULT),
        "accounting": "amplified BandMF: Poisson-subsampled Gaussian, q = B b / N, "
        "ceil(n / b) compositions (dp-accounting PLD)",
        "source": {
            "store": store_url,
            "version": latest.version,
            "fingerprint": rec["fingerprint"],
        },
    }
    with open(out + ".privacy.json", "w") as f:
        json.dump(report, f, indent=1)
    return report


def read_config(store_url: str, storage_options: dict[str, Any] | None = None) -> JobConfig:
    """The JobConfig recorded in a store's newest version."""
    store = Store.open(store_url, storage_options=storage_options, create=False)
    versions = store.versions()
    if not versions:
        raise StoreError(f"{store_url} has no committed version")
    return JobConfig.from_record(store.manifest(versions[-1]).records["config"])
