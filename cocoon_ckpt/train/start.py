"""Starting a job, in one pass: every check first, then the first write (create the
store, take the lease, keep a new job's key), so a refused start changes nothing. What
it produces is one value, `StartedJob`: the config with the sigma that runs, the store,
the version resumed from, the key, the allowances and the trainer.

The store is opened once; a target epsilon is calibrated once, inside the start, against
the version it resumes (`train.target_epsilon.resolve`: a new store calibrates, a resume
takes the stored sigma). The parts are built and their refusals run once
(`build.check_parts`): on every rank before anything is opened, or in one process once
the key file's place, the store and the key passed.

Under torch.distributed the ranks first agree on what they were asked
(`rank_agreement.agree_on_request`); every rank builds and checks its parts
(`parts_on_ranks`) and the ranks compare what they built; then the coordinator alone
checks the store, decides sigma and writes while the others wait for its lease, key,
sigma and version (`start_ranks`); a refusal on any rank is raised on every rank as it
was raised, so all exit alike with nothing written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.embedding.csc_window import read_in_windows
from cocoon_ckpt.keys import (
    check_key_file_place,
    key_id,
    load_key,
    manifest_mac_key,
    new_key,
    save_key,
    sealed_under,
    wrong_key,
)
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.build import CheckedParts, checked_parts
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext, check_distributed
from cocoon_ckpt.train.options import JobOptions
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.rank_agreement import (
    agree_on,
    agree_on_request,
    check_coordinator_key,
    found_key,
    parts_values,
)
from cocoon_ckpt.train.resume import check_records, malformed_version, prepare_trainer
from cocoon_ckpt.train.target_epsilon import resolve as resolve_sigma
from cocoon_ckpt.train.trainer import DPTrainer
from state import (
    CorruptVersionError,
    Store,
    StoreError,
    StoreNotFoundError,
    UnauthenticatedVersionError,
    Version,
)
from state.paths import manifest_path

__all__ = [
    "StartedJob",
    "parts_on_ranks",
    "start_job",
    "start_ranks",
    "trainer_on_ranks",
]

log = logging.getLogger(__name__)

#: What a job is given to run: its parts, a builder of them, or None (`config.job`).
Parts = JobParts | Callable[..., JobParts] | None


@dataclass(frozen=True, kw_only=True, slots=True)
class StartedJob:
    """A job started: every check passed, the first write done.

    Attributes:
        config: The job as it runs: its sigma decided (calibrated for a new store, the
            stored one on resume).
        store: The job's store, opened once (the coordinator holds its writer lease).
        version: The version the job resumes from; None for a new job.
        key: The noise key (I1).
        allow: The resume checks the user lifted.
        trainer: This rank's trainer, built, checked and restored from `version`.
        coordinator: Whether this process holds the lease and commits (every rank but
            rank 0 of a multi-process job reads only).
    """

    config: JobConfig
    store: Store
    version: Version | None
    key: bytes
    allow: ResumeAllowances
    trainer: DPTrainer
    coordinator: bool


@dataclass(frozen=True, slots=True)
class _Found:
    """What the store-side start settled: the trainer only where it was built there (one
    process); a multi-process job's ranks build theirs after the coordinator's start."""

    store: Store
    version: Version | None
    key: bytes
    config: JobConfig
    trainer: DPTrainer | None


def start_job(
    config: JobConfig,
    store_url: str,
    parts: Parts,
    options: JobOptions,
    *,
    dist: DistContext | None,
    leased: list[Store] | None = None,
    hold: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> StartedJob:
    """Start `config` on the store at `store_url`, or resume it from the newest valid
    version: every check, then the first write.

    Args:
        config: the job (sigma given, or a target epsilon this start calibrates).
        store_url: where its versions live.
        parts: the job's parts, a builder called as `builder(config)`, or None
            (`config.job` resolved).
        options: the key file, storage, takeover and the resume checks lifted.
        dist: the job's ranks (None: one process).
        leased: the store is appended here once its lease is taken, inside `hold()`
            (`Preemption.holding`: a signal there raises once it is over), so the
            caller's record for release holds every lease taken, whatever stops the start.
        hold: a context that holds signals off while the lease is taken.

    Raises:
        ConfigError: `store_url` is empty, or a part is refused (`build.check_parts`).
        ConfigMismatchError, NoiseKeyError, LeaseHeldError, CorruptVersionError,
        PrivacyBudgetError: as `open_job` states.
    """
    valid.text("store_url", store_url)
    # under torch.distributed the ranks first agree on what they were asked (nothing in
    # one process)
    agree_on_request(
        config,
        store_url,
        key_file=options.key_file,
        storage_options=options.storage_options,
        fs=options.fs,
    )
    builder = (lambda _config: parts) if isinstance(parts, JobParts) else parts
    # The parts are built and checked once per start, and the trainer is built from them
    # without checking them again: every rank's before rank 0 opens anything; one
    # process's when its start reaches the trainer (after the key file's place, the
    # store and the key, which refuse without importing the job).
    checked: Callable[[], CheckedParts]
    if dist is None:
        checked = functools.cache(lambda: checked_parts(config, builder))
    else:
        on_ranks = parts_on_ranks(config, builder, dist)
        checked = lambda: on_ranks  # noqa: E731
    found = start_ranks(config, store_url, dist, checked, options, leased=leased, hold=hold)
    trainer = found.trainer
    if trainer is None:
        # In a multi-process job every rank builds its trainer after rank 0's start
        # (a user's builder may hold collectives), then checks and restores it; a
        # refusal on any rank is raised on all.
        resume = (found.store, found.version) if found.version is not None else None
        trainer = trainer_on_ranks(found.config, found.key, checked(), dist, resume, options.allow)
    return StartedJob(
        config=found.config,
        store=found.store,
        version=found.version,
        key=found.key,
        allow=options.allow,
        trainer=trainer,
        coordinator=dist is None or dist.is_coordinator,
    )


def _open_existing(url: str, options: JobOptions) -> Store | None:
    """The store at `url`, or None where there is none yet (nothing is created)."""
    try:
        return Store.open(url, storage_options=options.storage_options, fs=options.fs, create=False)
    except StoreNotFoundError:
        return None


def _with_sigma(
    config: JobConfig, store: Store | None, latest: Version | None, url: str
) -> JobConfig:
    """`config` with its sigma decided, once: calibrated for a new job, the stored one on
    resume (`target_epsilon.resolve`); a config without a target as it is."""
    if store is None or latest is None:
        return resolve_sigma(config, None, store.url if store is not None else url)
    try:
        return resolve_sigma(
            config, latest.records["config"], f"{store.url} (version {latest.version})"
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise malformed_version(store, latest, exc) from None


def _start_here(
    asked: JobConfig,
    store_url: str,
    parts: Callable[[], CheckedParts],
    options: JobOptions,
    dist: DistContext | None,
    leased: list[Store] | None,
    hold: Callable[[], AbstractContextManager[object]],
) -> _Found:
    """Check everything, then write for the first time: create the store, take the lease,
    keep a new job's key (the coordinator's part of `start_job`; one process's whole
    store-side start). Returns the store (lease held), the version to resume from, the
    key, the config with its sigma and (single process) the trainer, built, checked and
    restored.

    A writer that commits between the checks and the lease (possible with `takeover`)
    is caught: the checks run again, lease held, against its version.
    """
    key_file, allow = options.key_file, options.allow
    if key_file is not None:
        check_key_file_place(key_file, store_url)  # before the store is created
    store = _open_existing(store_url, options)
    try:
        for _ in range(2):
            seen = store.versions() if store is not None else []
            # the key first: every version is read authenticated by it
            key = _job_key(store, key_file, resuming=bool(seen))
            if store is not None:  # versions read, and the commits sealed, by the key
                authenticate(store, key, allow)
            latest = _newest(store, key, allow, asked) if store and seen else None
            config = _with_sigma(asked, store, latest, store_url)
            resume = (store, latest) if store is not None and latest is not None else None
            trainer = None
            if dist is None:
                trainer = prepare_trainer(config, key, parts(), None, resume, allow)
            elif resume is not None:
                check_records(*resume, config.to_record(), None, key, allow.generator_change)
            try:
                if store is None:
                    store = Store.open(
                        store_url, storage_options=options.storage_options, fs=options.fs
                    )
                    authenticate(store, key, allow)
                if store.lease is None:
                    with hold():
                        store.acquire_lease(
                            takeover=options.takeover, expiry_s=config.lease_expiry_s
                        )
                        if leased is not None:
                            leased.append(store)
                if store.versions()[-1:] == seen[-1:]:
                    if latest is None:
                        save_key(store, key_file, key)
                    return _Found(store, latest, key, config, trainer)
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


def authenticate(store: Store, key: bytes, allow: ResumeAllowances) -> None:
    """Read `store` authenticated by the job's key, and seal what it commits."""
    store.authenticate_with(manifest_mac_key(key), require=not allow.unauthenticated)


def _newest(store: Store, key: bytes, allow: ResumeAllowances, config: JobConfig) -> Version | None:
    """The version a resume continues, its manifest authenticated (`authenticate`),
    every array verified: read once and kept for the restore, but a CSC the job reads in
    windows by a streamed pass (never whole)."""
    emb = config.embedding
    windowed = emb is not None and emb.csc_window_steps is not None
    try:
        latest = store.latest(
            allow_fallback=allow.fallback,
            stream=read_in_windows if windowed else (lambda _name: False),
        )
    except UnauthenticatedVersionError as exc:
        sealed = sealed_under(store, key, below=exc.version)
        if sealed is not None:  # a format-4 writer seals every version it commits
            exc.args = (
                f"{exc}: version {sealed} of this store is sealed under the job's key, so "
                "this one's MACs were stripped; it is refused. Audit the store "
                "(cocoon-ckpt audit --key-file K) and resume with --allow-fallback from the "
                "newest version that verifies",
            )
        else:
            exc.args = (
                f"{exc}; if cocoon-ckpt before store format 4 wrote it and no one else can "
                "write the store, resume once with --allow-unauthenticated "
                "(ResumeAllowances(unauthenticated=True)): the versions after it are sealed",
            )
        raise
    except CorruptVersionError:  # a MAC failed (or every version did, with fallback)
        wrong = wrong_key(store, key)
        if wrong is not None:
            raise wrong from None
        raise
    if latest is not None and not latest.manifest.sealed:
        sealed = sealed_under(store, key, below=latest.version)
        if sealed is not None:  # allowed unauthenticated, but certainly stripped
            raise UnauthenticatedVersionError(
                f"version {latest.version} of {store.url} carries no MAC while version "
                f"{sealed} is sealed under the job's key: its MACs were stripped, and "
                "--allow-unauthenticated does not accept a stripped version. Audit the store "
                "and resume with --allow-fallback from a version that verifies",
                version=latest.version,
                path=manifest_path(latest.version),
                record="header",
            )
    return latest


def _job_key(store: Store | None, key_file: str | None, *, resuming: bool) -> bytes:
    """The job's key, read but not yet written: the key a start finds (`found_key`), or a
    new one that `save_key` keeps once every check has passed."""
    key = found_key(store, key_file, resuming=resuming)
    return key if key is not None else new_key()


def parts_on_ranks(
    config: JobConfig, builder: Callable[..., JobParts] | None, dist: DistContext
) -> CheckedParts:
    """The parts every rank has built (once: a user's builder may hold collectives and
    draws the model's initial weights) and checked (`build.check_parts`), before the
    coordinator writes anything: a refusal on any rank is raised on every rank, with
    nothing written."""
    built: list[CheckedParts] = []

    def build() -> dict[str, str]:
        check_distributed(config.embedding, dist.world, config.dp.bands)
        built.append(checked_parts(config, builder))
        return parts_values(config, built[0].parts)

    # a failure on any rank, or parts that differ between ranks (model shapes, optimizer,
    # dataset), raised on every rank
    agree_on(dist, build)
    return built[0]


def start_ranks(
    config: JobConfig,
    store_url: str,
    dist: DistContext | None,
    parts: Callable[[], CheckedParts],
    options: JobOptions,
    *,
    leased: list[Store] | None = None,
    hold: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> _Found:
    """The store (lease held by the coordinator), the version to resume from, the key,
    the config with the coordinator's sigma, and (single process) the trainer, checked
    and restored."""
    if dist is None:
        return _start_here(config, store_url, parts, options, None, leased, hold)
    started: list[_Found] = []

    def start() -> tuple[int | None, str, float | None, bool]:
        started.append(_start_here(config, store_url, parts, options, dist, leased, hold))
        found = started[0]
        dp = found.config.dp
        version = found.version.version if found.version is not None else None
        return version, key_id(found.key), dp.noise_multiplier, dp.is_calibrated

    # the other ranks wait for the coordinator's lease, key, sigma and choice of version,
    # and raise its refusal as it raised it: rank 0 alone calibrates, and every rank
    # runs that float (a fit on another host could differ in its last bits)
    try:
        version, coordinator_key, sigma, calibrated = dist.from_coordinator(start)
    except BaseException:
        _release(started)  # the broadcast of rank 0's "ok" failed after its lease
        raise
    mine = started[:1]  # the coordinator's start, or this rank's open below
    failure: BaseException | None = None
    if not mine:
        # what only this rank reads (its host's key file, its view of the store) may fail
        # here alone: agreed, so no rank goes on to a collective another never reaches
        try:
            store = Store.open(
                store_url, storage_options=options.storage_options, fs=options.fs, create=False
            )
            key = load_key(store, options.key_file)
            # Every key visible before the first write was compared then
            # (`agree_on_request`): this one differs only where rank 0 made a new key and
            # the key file's path names another file here (another host's disk). A new
            # key exists nowhere before rank 0 keeps it after its lease (it never crosses
            # the network: ranks compare ids), so this check comes right after; refused,
            # the lease is released and no version was committed.
            check_coordinator_key(coordinator_key, key, dist.rank, dist.world)
            authenticate(store, key, options.allow)
            latest = store.read(version) if version is not None else None
            mine.append(_Found(store, latest, key, _sigma_of(config, sigma, calibrated), None))
        except BaseException as exc:
            failure = exc
    try:
        dist.agree(failure)
    except BaseException:
        _release(started)
        raise
    return mine[0]  # agree raised where any rank had none


def _sigma_of(config: JobConfig, sigma: float | None, calibrated: bool) -> JobConfig:
    """`config` running the coordinator's sigma where a target epsilon decides it (the
    ranks agreed on every other field, target included)."""
    if config.dp.target_epsilon is None:
        return config
    dp = dataclasses.replace(config.dp, noise_multiplier=sigma, calibrated=calibrated)
    return dataclasses.replace(config, dp=dp)


def _release(started: list[_Found]) -> None:
    """The coordinator's lease released, where its start took one."""
    if started:
        started[0].store.release_lease()


def trainer_on_ranks(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | CheckedParts | None,
    dist: DistContext | None,
    resume: tuple[Store, Version] | None,
    allow: ResumeAllowances,
) -> DPTrainer:
    """Every rank's trainer, built, checked against `resume` and restored; a refusal on
    any rank (its data's digest, its device) is raised on every rank as itself, so none
    waits in a step's collective for a rank that stopped (`dist` None: one process's).

    A rank that fails before the mechanism's broadcast (`build.rank0_mechanism`) would
    meet the others in another collective; what runs before it reads the one verified
    version every rank reads, so it fails alike on every rank.
    """
    if dist is None:
        return prepare_trainer(config, key, builder, None, resume, allow)
    try:
        trainer = prepare_trainer(config, key, builder, dist, resume, allow)
    except BaseException as exc:
        dist.agree(exc)  # raises, on every rank
        raise
    try:
        dist.agree(None)  # the other ranks' trainers passed too
        if resume is None:
            # A new job's ranks take the coordinator's gradient thread count: the record
            # holds rank 0's, and a resume sets every rank to it (train.grad_threads), so
            # a rank whose machine defaulted to another count would change bits there.
            trainer.grad_threads = dist.broadcast_object(trainer.grad_threads)
    except BaseException:
        trainer.close()
        raise
    return trainer
