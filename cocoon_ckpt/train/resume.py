"""Resume checks: a version's records against this job (config, model shapes, key,
generator backend, mechanism, gradient thread count), then the trainer restored from it.

A BLT is never fitted again on resume: the trainer is built from the parameters the
version holds (a fit elsewhere may differ in the last bits, and the noise with it), and
they are checked against the sensitivity the version's accountant recorded.

A record that cannot be read is a damaged version (`CorruptVersionError`), never a
crash with a bare KeyError.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.generator import check_generator_backend
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.errors import CocoonError, ConfigMismatchError, NoiseKeyError, StoredStateError
from cocoon_ckpt.format.codec import decode
from cocoon_ckpt.format.stored import records_of, stored_table_plans
from cocoon_ckpt.keys import key_id
from cocoon_ckpt.train import config as cfgmod
from cocoon_ckpt.train.allowances import ResumeAllowances
from cocoon_ckpt.train.build import CheckedParts, build_trainer, model_shapes
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.grad_threads import resumed_grad_threads
from cocoon_ckpt.train.identity import identity_differences
from cocoon_ckpt.train.mechanisms import blt_sensitivity
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.trainer import DPTrainer
from state import CorruptVersionError, Store, Version
from state.manifest import manifest_path

__all__ = [
    "check_blt",
    "check_identity",
    "check_records",
    "malformed_version",
    "prepare_trainer",
    "restore_grad_threads",
    "stored_blt",
]


def prepare_trainer(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | CheckedParts | None,
    dist: DistContext | None,
    resume: tuple[Store, Version] | None,
    allow: ResumeAllowances,
) -> DPTrainer:
    """The job's trainer; with `resume` = (store, version), checked against the version
    and restored from it (`allow`: the checks the user lifted)."""
    plans = None
    blt = None
    if resume is not None:
        try:
            plans = stored_table_plans(resume[1])
            blt = stored_blt(resume[1], config)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise malformed_version(*resume, exc) from None
    trainer = build_trainer(config, key, builder, plans, dist, blt)
    try:
        if resume is not None:
            store, latest = resume
            shapes = model_shapes(trainer)
            record = config.to_record()
            check_records(store, latest, record, shapes, key, allow.generator_change)
            check_identity(store, latest, trainer, allow.device_change)
            restore_grad_threads(store, latest, trainer)
            like = trainer.state_dict()
            check_blt(store, latest, trainer)
            if records_of(latest).get("mechanism") != like["mechanism"]:
                raise ConfigMismatchError(
                    f"{store.url}: the band coefficients computed now differ from version "
                    f"{latest.version}'s; resuming would add different noise",
                    ["mechanism.coefficients"],
                )
            try:
                trainer.load_state_dict(decode(latest, like))
            except (KeyError, TypeError, IndexError, AttributeError) as exc:
                raise malformed_version(store, latest, exc) from None
            except StoredStateError as exc:  # another job's state: name the version
                raise StoredStateError(f"version {latest.version} of {store.url}: {exc}") from None
            except ValueError as exc:
                if isinstance(exc, CocoonError):  # our own refusals keep their class
                    raise
                # a stored state this job cannot take (the sampler's, the accountant's):
                # the version's records, not the request, are wrong (exit 1, not 2)
                raise malformed_version(store, latest, exc) from None
            step = trainer.step_index
            if type(step) is not int or step != latest.step or not 0 < step <= config.dp.steps:
                raise malformed_version(
                    store,
                    latest,
                    ValueError(
                        f"trainer.step={step!r}, the manifest says step {latest.step} of "
                        f"{config.dp.steps}"
                    ),
                )
            # Derived, not trusted (I7): the accountant has counted every step the
            # version took, no more and no fewer, or the epsilon it reports is not the run's.
            if trainer.accountant.steps != step:
                raise malformed_version(
                    store,
                    latest,
                    ValueError(
                        f"accountant.steps={trainer.accountant.steps!r}, the version is at "
                        f"step {step}"
                    ),
                )
    except BaseException:
        trainer.close()
        raise
    return trainer


def stored_blt(version: Version, config: JobConfig) -> BLT | None:
    """The BLT a version holds when this job runs one (None: another kind, which the
    config check refuses, or BandMF).

    Raises:
        ValueError, KeyError, TypeError: the mechanism record is not a valid BLT's.
    """
    rec = records_of(version).get("mechanism")
    if config.dp.mechanism is not MechanismKind.BLT or not isinstance(rec, dict):
        return None
    if rec.get("kind") != "BLT":
        return None
    return BLT.from_state_dict(dict(rec))


def check_blt(store: Store, latest: Version, trainer: DPTrainer) -> None:
    """Refuse a stored BLT whose sensitivity is not the one the version's accountant
    recorded: its parameters were changed after the run accounted them, so resuming
    would add noise the epsilon does not describe."""
    sens = blt_sensitivity(trainer.config, trainer.mechanism)
    if sens is None:
        return
    acc = records_of(latest).get("accountant")
    recorded = acc.get("sensitivity") if isinstance(acc, dict) else None
    if recorded != sens:
        raise ConfigMismatchError(
            f"{store.url} (version {latest.version}): the stored BLT's min-sep sensitivity "
            f"is {sens!r}, its accountant recorded {recorded!r}; the BLT parameters were "
            "changed after the run accounted them. Resume from a version whose records "
            "agree, or start a new store",
            ["mechanism.buf_decay", "mechanism.output_scale"],
        )


def restore_grad_threads(store: Store, latest: Version, trainer: DPTrainer) -> None:
    """Run the trainer's gradients at the thread count the version records (none
    recorded: the count it was built with, recorded from now on).

    Raises:
        ConfigMismatchError: the trainer was asked for another count explicitly.
        CorruptVersionError: the record is not a thread count.
    """
    where = f"{store.url} (version {latest.version})"
    try:
        stored = resumed_grad_threads(
            records_of(latest).get("grad_threads"), trainer.requested_grad_threads, where
        )
    except ConfigMismatchError:
        raise
    except ValueError as exc:
        raise malformed_version(store, latest, exc) from None
    if stored is not None:
        trainer.grad_threads = stored


def check_identity(
    store: Store, latest: Version, trainer: DPTrainer, allow_device_change: bool = False
) -> None:
    """Refuse a resume whose real objects (optimizer, scheduler, dataset) differ from
    those the version records, listing each difference (versions written before the
    identity was recorded are not compared; a sealed, format-4 version without it is
    refused); `allow_device_change` leaves the device
    type out (the noise is the same on every device; the gradients' last bits are not)."""
    stored = records_of(latest).get("identity")
    if stored is None:
        if latest.manifest.sealed:
            # every version a format-4 writer seals carries it: missing, it was removed,
            # and the optimizer, scheduler and data checks would be skipped silently
            raise malformed_version(
                store, latest, KeyError("the identity record is missing from a sealed version")
            )
        return  # written before the identity was recorded
    try:
        diffs = identity_differences(
            stored, trainer.identity, allow_device_change=allow_device_change
        )
    except (TypeError, AttributeError) as exc:
        raise malformed_version(store, latest, exc) from None
    if diffs:
        raise ConfigMismatchError(
            f"{store.url} (version {latest.version}) was written by a job whose optimizer, "
            "scheduler or data differ from this one's; resuming would not continue it. "
            "Differences: " + "; ".join(diffs) + ". Build the job as it was, or use a new "
            "store for the new job",
            diffs,
        )


def malformed_version(store: Store, latest: Version, exc: BaseException) -> CorruptVersionError:
    v = latest.version
    return CorruptVersionError(
        f"version {v} of {store.url}: a record is malformed ({type(exc).__name__}: {exc}); "
        "it cannot be resumed. Start a new store, or remove this version and resume from "
        "an older one",
        version=v,
        path=manifest_path(v),
    )


def check_records(
    store: Store,
    latest: Version,
    record: dict[str, Any],
    shapes: dict[str, list[int]] | None,
    key: bytes,
    allow_generator_change: bool,
) -> None:
    """The resume checks that need no trainer: config (and model shapes when given),
    key, generator backend."""
    rec = records_of(latest)
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
        raise malformed_version(store, latest, exc) from None
    if rec.get("key_id") != key_id(key):
        raise NoiseKeyError(
            f"{store.url}: the noise key given does not match the key of version "
            f"{latest.version}; resuming would add unrelated noise. Use the job's own key"
        )
    rng = record["dp"].get("noise_rng", "default")
    check_generator_backend(dict(generator), rng=rng, allow_change=allow_generator_change)
