"""Starting a job: every check first, then the first write (create the store, take the
lease, keep a new job's key), so a refused start changes nothing.

Under torch.distributed every rank builds and checks its parts before the coordinator
writes (`parts_on_ranks`), and the ranks compare what they built (`rank_agreement`, as
they compared their flags, store and key before); then the coordinator alone checks the
store and writes while the others wait for its lease, key and version (`start_ranks`); a
refusal on any rank is raised on every rank as it was raised, so all exit alike with
nothing written.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

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
from cocoon_ckpt.train.build import check_parts, job_parts
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext, check_distributed
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.rank_agreement import (
    agree_on,
    check_coordinator_key,
    found_key,
    parts_values,
)
from cocoon_ckpt.train.resume import check_records, prepare_trainer
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

__all__ = ["parts_on_ranks", "start_job", "start_ranks", "trainer_on_ranks"]

log = logging.getLogger("cocoon_ckpt.train.runner")


def _open_existing(url: str, storage_options: dict[str, Any] | None, fs: Any) -> Store | None:
    """The store at `url`, or None where there is none yet (nothing is created)."""
    try:
        return Store.open(url, storage_options=storage_options, fs=fs, create=False)
    except StoreNotFoundError:
        return None


def start_job(
    config: JobConfig,
    store_url: str,
    *,
    storage_options: dict[str, Any] | None,
    fs: Any,
    builder: Callable[..., JobParts] | None,
    key_file: str | None,
    takeover: bool,
    dist: DistContext | None,
    allow: ResumeAllowances,
    leased: list[Store] | None = None,
    hold: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> tuple[Store, Version | None, bytes, DPTrainer | None]:
    """Check everything, then write for the first time: create the store, take the lease,
    keep a new job's key. Returns the store (lease held), the version to resume from, the
    key, and (single process) the trainer, built, checked and restored.

    `allow` lifts resume checks (`open_job`'s `ResumeAllowances`). The
    lease is taken inside `hold()` (`Preemption.holding`: a signal there raises once it
    is over) and the store appended to `leased` there, so the caller's record for
    release holds every lease taken, whatever stops the start.

    A writer that commits between the checks and the lease (possible with `takeover`)
    is caught: the checks run again, lease held, against its version.

    Raises:
        ConfigError: `config.dp.target_epsilon` is not calibrated yet (`open_job`
            calibrates it: `train.target_epsilon.calibrated_job`), before anything opens.
    """
    _ = config.dp.sigma  # the noise multiplier that will run, given or calibrated
    if key_file is not None:
        check_key_file_place(key_file, store_url)  # before the store is created
    store = _open_existing(store_url, storage_options, fs)
    try:
        for _ in range(2):
            seen = store.versions() if store is not None else []
            # the key first: every version is read authenticated by it
            key = _job_key(store, key_file, resuming=bool(seen))
            if store is not None:  # versions read, and the commits sealed, by the key
                authenticate(store, key, allow)
            latest = _newest(store, key, allow) if store and seen else None
            resume = (store, latest) if store is not None and latest is not None else None
            trainer = None
            if dist is None:
                trainer = prepare_trainer(config, key, builder, None, resume, allow)
            elif resume is not None:
                check_records(*resume, config.to_record(), None, key, allow.generator_change)
            try:
                if store is None:
                    store = Store.open(store_url, storage_options=storage_options, fs=fs)
                    authenticate(store, key, allow)
                if store.lease is None:
                    with hold():
                        store.acquire_lease(takeover=takeover, expiry_s=config.lease_expiry_s)
                        if leased is not None:
                            leased.append(store)
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


def authenticate(store: Store, key: bytes, allow: ResumeAllowances) -> None:
    """Read `store` authenticated by the job's key, and seal what it commits."""
    store.authenticate_with(manifest_mac_key(key), require=not allow.unauthenticated)


def _newest(store: Store, key: bytes, allow: ResumeAllowances) -> Version | None:
    """The version a resume continues, its manifest authenticated (`authenticate`)."""
    try:
        latest = store.latest(allow_fallback=allow.fallback)
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
) -> Callable[..., JobParts]:
    """A builder of the parts every rank has built (once: a user's builder may hold
    collectives and draws the model's initial weights) and checked as its trainer would,
    before the coordinator writes anything: a refusal on any rank is raised on every
    rank, with nothing written."""
    built: list[JobParts] = []

    def build() -> dict[str, str]:
        check_distributed(config.embedding, dist.world)
        built.append(job_parts(config, builder))
        check_parts(config, built[0])
        return parts_values(config, built[0])

    # a failure on any rank, or parts that differ between ranks (model shapes, optimizer,
    # dataset), raised on every rank
    agree_on(dist, build)
    parts = built[0]
    return lambda _config: parts


def start_ranks(
    config: JobConfig,
    store_url: str,
    dist: DistContext | None,
    builder: Callable[..., JobParts] | None,
    **kw: Any,
) -> tuple[Store, Version | None, bytes, DPTrainer | None]:
    """The store (lease held by the coordinator), the version to resume from, the key,
    and (single process) the trainer, checked and restored."""
    if dist is None:
        return start_job(config, store_url, builder=builder, dist=None, **kw)
    started: list[tuple[Store, Version | None, bytes, DPTrainer | None]] = []

    def start() -> tuple[int | None, str]:
        started.append(start_job(config, store_url, builder=builder, dist=dist, **kw))
        latest = started[0][1]
        return (latest.version if latest is not None else None), key_id(started[0][2])

    # the other ranks wait for the coordinator's lease, key and choice of version, and
    # raise its refusal as it raised it
    try:
        version, coordinator_key = dist.from_coordinator(start)
    except BaseException:
        _release(started)  # the broadcast of rank 0's "ok" failed after its lease
        raise
    mine = started[:1]  # the coordinator's start, or this rank's open below
    failure: BaseException | None = None
    if not mine:
        # what only this rank reads (its host's key file, its view of the store) may fail
        # here alone: agreed, so no rank goes on to a collective another never reaches
        try:
            opts, fs = kw["storage_options"], kw["fs"]
            store = Store.open(store_url, storage_options=opts, fs=fs, create=False)
            key = load_key(store, kw["key_file"])
            # Every key visible before the first write was compared then
            # (`agree_on_request`): this one differs only where rank 0 made a new key and
            # the key file's path names another file here (another host's disk). A new
            # key exists nowhere before rank 0 keeps it after its lease (it never crosses
            # the network: ranks compare ids), so this check comes right after; refused,
            # the lease is released and no version was committed.
            check_coordinator_key(coordinator_key, key, dist.rank, dist.world)
            authenticate(store, key, kw["allow"])
            latest = store.read(version) if version is not None else None
            mine.append((store, latest, key, None))
        except BaseException as exc:
            failure = exc
    try:
        dist.agree(failure)
    except BaseException:
        _release(started)
        raise
    return mine[0]  # agree raised where any rank had none


def _release(started: list[tuple[Store, Version | None, bytes, DPTrainer | None]]) -> None:
    """The coordinator's lease released, where its start took one."""
    if started:
        started[0][0].release_lease()


def trainer_on_ranks(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | None,
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
