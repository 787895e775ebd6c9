"""Target epsilon: sigma calibrated once when a job starts, recorded, reused on resume.

A config with `DPConfig.target_epsilon` names the privacy the whole job must meet. The
noise multiplier that meets it is found once, when the job starts on a store without
versions (`dp.accounting.noise_multiplier_for`, about 1 s), and the config record
carries it beside the target. A resume takes it from the store's newest version and
never recalibrates, so the noise cannot move with the accounting code.

A BLT job (`mechanism='blt'`) is calibrated under its own accounting: one Gaussian at
the min-sep sensitivity of the BLT fitted for its steps and bands (fitted once per
process: the trainer built next reuses it), `dp.accounting.blt_noise_multiplier`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any

from cocoon_ckpt.dp.accounting.amplified import epsilon
from cocoon_ckpt.dp.accounting.calibration import blt_noise_multiplier, noise_multiplier_for
from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity, blt_epsilon
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError
from cocoon_ckpt.format.fingerprint import check_resume
from cocoon_ckpt.train.config import DPConfig, JobConfig
from cocoon_ckpt.train.resume import malformed_version
from state import Store, StoreNotFoundError

if TYPE_CHECKING:
    from cocoon_ckpt.train.distributed import DistContext

__all__ = ["calibrate", "calibrated_job", "check_target", "resolve"]

#: The dp fields the calibration reads, with the value an older record's absence means.
_INPUTS: dict[str, Any] = {
    "target_epsilon": None,
    "accountant": "pld",
    "steps": None,
    "batch_size": None,
    "dataset_size": None,
    "bands": 1,
    "delta": 1e-5,
}


def _blt_sensitivity(dp: DPConfig) -> float | None:
    """The min-sep sensitivity of the BLT this job fits (None: not a BLT job)."""
    if dp.mechanism is not MechanismKind.BLT:
        return None
    from cocoon_ckpt.dp.blt.optimize import job_blt  # torch: only for a BLT job

    return accounting_sensitivity(job_blt(dp.steps, dp.bands), dp.steps, dp.bands)


def calibrate(dp: DPConfig) -> DPConfig:
    """`dp` with sigma calibrated for its target: the smallest sigma >= 0.3 whose epsilon
    after `dp.steps` steps at `dp.delta` is <= `dp.target_epsilon` under `dp.accountant`.
    A config that has sigma already is returned as it is.

    Raises:
        PrivacyBudgetError: no sigma >= 0.3 reaches the target.
    """
    if dp.noise_multiplier is not None or dp.target_epsilon is None:
        return dp
    sens = _blt_sensitivity(dp)
    if sens is not None:
        sigma = blt_noise_multiplier(dp.target_epsilon, sens, dp.delta)
        return dataclasses.replace(dp, noise_multiplier=sigma, calibrated=True)
    sigma = noise_multiplier_for(
        dp.target_epsilon,
        dp.dataset_size,
        dp.batch_size,
        dp.steps,
        dp.bands,
        dp.delta,
        str(dp.accountant),
    )
    return dataclasses.replace(dp, noise_multiplier=sigma, calibrated=True)


def check_target(dp: DPConfig) -> None:
    """Refuse a calibrated config whose sigma does not meet its target (a record edited
    by hand, or a target changed beside a kept sigma).

    Raises:
        ConfigError: epsilon after `dp.steps` steps exceeds `dp.target_epsilon`.
    """
    if not dp.is_calibrated or dp.target_epsilon is None:
        return
    sens = _blt_sensitivity(dp)
    spent = (
        blt_epsilon(dp.sigma, sens, dp.delta)
        if sens is not None
        else epsilon(
            dp.sigma,
            dp.dataset_size,
            dp.batch_size,
            dp.steps,
            dp.bands,
            dp.delta,
            str(dp.accountant),
        )
    )
    if spent > dp.target_epsilon:
        raise ConfigError(
            f"DPConfig.noise_multiplier={dp.sigma} gives epsilon={spent:.6g} after "
            f"{dp.steps} steps, above target_epsilon={dp.target_epsilon}; drop "
            "noise_multiplier so the job calibrates it"
        )


def _inputs(dp_record: dict[str, Any]) -> tuple[Any, ...]:
    # of the mechanism, the calibration reads only whether it is a BLT (its accounting)
    blt = dp_record.get("mechanism") == MechanismKind.BLT.value
    return (*(dp_record.get(k, default) for k, default in _INPUTS.items()), blt)


def resolve(config: JobConfig, stored: dict[str, Any] | None, where: str) -> JobConfig:
    """`config` with its sigma decided: calibrated for a fresh job (`stored` None), or the
    sigma of `stored`, the config record of the version a resume continues.

    Args:
        config: the job; one without a target is returned as it is.
        stored: the resumed version's config record, or None for a fresh job.
        where: the store and version, for messages.

    Raises:
        ConfigMismatchError: a resume changes what the calibration reads (the target,
            the accountant, steps, B, N, b or delta), listing each difference.
        ConfigError: a calibrated config's sigma does not meet its target.
        PrivacyBudgetError: no sigma >= 0.3 reaches the target.
        KeyError, TypeError, AttributeError: `stored` is not a config record.
    """
    dp = config.dp
    if dp.target_epsilon is None:
        return config
    if stored is None:
        check_target(dp)
        return dataclasses.replace(config, dp=calibrate(dp))
    if dp.noise_multiplier is not None:
        return config  # calibrated already: the start compares it with the stored config
    stored_dp = stored["dp"]
    sigma = stored_dp.get("noise_multiplier")
    if _inputs(stored_dp) == _inputs(dp.to_record()) and isinstance(sigma, (int, float)):
        resumed = dataclasses.replace(
            config, dp=dataclasses.replace(dp, noise_multiplier=float(sigma), calibrated=True)
        )
        # Derived, not trusted: the stored sigma must still meet the target it was
        # calibrated for (a record edited in the store, I7).
        try:
            check_target(resumed.dp)
        except ConfigError as exc:
            spent = str(exc).split(";")[0].split(" gives ", 1)[-1]
            raise ConfigMismatchError(
                f"{where}: the stored noise_multiplier={sigma!r} does not meet the job's "
                f"target_epsilon={dp.target_epsilon} (it gives {spent}); the store's config "
                "was altered, so the job is not resumed: audit the store",
                [f"dp.noise_multiplier: stored {sigma!r} misses target {dp.target_epsilon}"],
            ) from None
        return resumed
    # Refused: the listing names what was asked differently; sigma would only follow.
    asked = config.to_record()
    asked["dp"]["noise_multiplier"] = sigma
    check_resume(stored, asked, {}, {}, where)
    return dataclasses.replace(config, dp=calibrate(dp))


def calibrated_job(
    config: JobConfig,
    store_url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    fs: Any = None,
    allow_fallback: bool = False,
) -> JobConfig:
    """`config` with its sigma decided against the store at `store_url` (see `resolve`):
    calibrated when the store has no version, else the newest version's. Opens nothing
    for a config without a target, and writes nothing.

    Raises:
        As `resolve`; CorruptVersionError: the newest version cannot be read and
        `allow_fallback` is off, or its config record is malformed.
    """
    if config.dp.target_epsilon is None:
        return config
    ranks = _ranks()
    if ranks is None:
        return _calibrated_here(config, store_url, storage_options, fs, allow_fallback)
    # Rank 0 alone decides sigma and every rank runs that float: a calibration (a BLT
    # fit, a root search) run on each rank costs each its CPU and could differ in its
    # last bits on another host. A refusal on rank 0 is raised on every rank.
    sigma, calibrated = ranks.from_coordinator(
        lambda: _sigma(_calibrated_here(config, store_url, storage_options, fs, allow_fallback))
    )
    dp = dataclasses.replace(config.dp, noise_multiplier=sigma, calibrated=calibrated)
    return dataclasses.replace(config, dp=dp)


def _sigma(config: JobConfig) -> tuple[float | None, bool]:
    return config.dp.noise_multiplier, config.dp.is_calibrated


def _ranks() -> DistContext | None:
    """The job's ranks under torch.distributed (None: one process). torch is imported
    only where a launcher set WORLD_SIZE or it is loaded already (the CLI's calibration
    runs before anything else needs it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "torch.distributed" not in sys.modules:
        return None
    from cocoon_ckpt.train.distributed import DistContext

    return DistContext.from_env()


def _calibrated_here(
    config: JobConfig,
    store_url: str,
    storage_options: dict[str, Any] | None,
    fs: Any,
    allow_fallback: bool,
) -> JobConfig:
    """`calibrated_job` in this process alone."""
    try:
        store = Store.open(store_url, storage_options=storage_options, fs=fs, create=False)
    except StoreNotFoundError:
        return resolve(config, None, store_url)
    # Only the config record is read: every version of a store carries the same sigma,
    # and the start that follows verifies the version it resumes.
    latest = store.latest(verify=False, allow_fallback=allow_fallback) if store.versions() else None
    if latest is None:
        return resolve(config, None, store.url)
    where = f"{store.url} (version {latest.version})"
    try:
        return resolve(config, latest.records["config"], where)
    except (KeyError, TypeError, AttributeError) as exc:
        raise malformed_version(store, latest, exc) from None
