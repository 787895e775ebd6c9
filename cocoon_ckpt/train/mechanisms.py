"""A job's mechanism, its noise and its accountant, built from the config: BandMF
(`BandMFNoise`, amplified accounting) or BLT (`BLTNoise`, one Gaussian at the
min-sep sensitivity, `dp.blt.accounting`).

The kind decides three things that must agree, so they are built in one place: the
strategy C, the noise state the checkpoints carry (BandMF's b-1 ring slots or BLT's d
buffers, both a `RingHistory` the tiers can hold), and how epsilon is accounted. The
noise itself comes from `cocoon_ckpt.dp.noise_factory`, the one place that names its
classes; the trainer, the checkpoint and the resume hold a `NoiseMechanism`
(`cocoon_ckpt.dp.noise_mechanism`) and ask it.
"""

from __future__ import annotations

from typing import Any, TypeAlias

from cocoon_ckpt.dp.accounting.accountant import Accountant
from cocoon_ckpt.dp.blt.accounting import accounting_sensitivity
from cocoon_ckpt.dp.blt.optimize import job_blt
from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.noise_factory import noise_for, noise_rows
from cocoon_ckpt.dp.noise_mechanism import NoiseMechanism
from cocoon_ckpt.errors import ConfigError, StoredStateError
from cocoon_ckpt.tiers.build import build_history
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import DPConfig

__all__ = [
    "Mechanism",
    "blt_sensitivity",
    "build_accountant",
    "build_mechanism",
    "build_noise",
    "check_mechanism",
    "mechanism_from_state",
    "tables_mechanism",
]

Mechanism: TypeAlias = BandMF | BLT
"""A strategy the trainer runs."""


def build_mechanism(config: DPConfig) -> Mechanism:
    """The mechanism a config asks for; a BLT is fitted once per (steps, bands) in this
    process (`dp.blt.optimize.job_blt`). A resume passes the stored one instead.

    Raises:
        ConfigError: a kind this release cannot build.
    """
    if config.mechanism is MechanismKind.OPTIMIZED:
        return BandMF.optimized(config.bands, config.steps)
    if config.mechanism is MechanismKind.OPTIMIZED_COLNORM:
        return BandMF.optimized_colnorm(config.bands, config.steps)
    if config.mechanism is MechanismKind.BANDED_SQRT:
        return BandMF.banded_sqrt(config.bands, config.steps)
    if config.mechanism is MechanismKind.BLT:
        return job_blt(config.steps, config.bands)
    raise ConfigError(f"DPConfig.mechanism={config.mechanism.value!r} cannot be built yet")


def mechanism_from_state(state: dict[str, Any]) -> Mechanism:
    """The mechanism a `state_dict()` describes, bit for bit (a BandMF's coefficients and
    a BLT's parameters as stored, never refitted).

    Raises:
        StoredStateError: `state` is neither a BandMF's nor a BLT's (its `kind` is named).
    """
    kind = state.get("kind")
    if kind == "BLT":
        return BLT.from_state_dict(state)
    if kind == "BandMF":
        return BandMF.from_state_dict(state)
    raise StoredStateError(f"mechanism state of kind {kind!r}: expected 'BandMF' or 'BLT'")


def check_mechanism(config: DPConfig, mechanism: Mechanism, *, embedding: bool) -> None:
    """Refuse a mechanism the config does not name, or a BLT where this release cannot
    run one.

    Raises:
        ConfigError: a BLT object under another kind (or the reverse): the config record
            is what readers account the store by; a BLT for other steps; a BLT with
            embedding tables.
    """
    is_blt = isinstance(mechanism, BLT)
    if is_blt != (config.mechanism is MechanismKind.BLT):
        raise ConfigError(
            f"DPConfig.mechanism={config.mechanism.value!r} but the trainer was given a "
            f"{type(mechanism).__name__}: readers account the store by the config, so pass "
            "mechanism='blt' with a BLT (and a BandMF with any other kind)"
        )
    if is_blt and mechanism.steps != config.steps:
        raise ConfigError(
            f"the BLT was built for steps={mechanism.steps}, DPConfig.steps={config.steps}: "
            "fit it for the run's steps (its scale and sensitivity depend on them)"
        )
    if is_blt and embedding:
        raise ConfigError(
            "DPConfig.mechanism='blt' with embedding tables: their coalesced noise is "
            "BandMF's in this release; use a banded mechanism, or drop EmbeddingConfig"
        )


def blt_sensitivity(config: DPConfig, mechanism: Mechanism) -> float | None:
    """A BLT's min-sep sensitivity at the config's steps and bands (None: BandMF)."""
    if not isinstance(mechanism, BLT):
        return None
    return accounting_sensitivity(mechanism, config.steps, config.bands)


def build_noise(
    mechanism: Mechanism,
    dim: int,
    key: bytes,
    noise_std: float,
    dtype: str,
    *,
    start: int,
    stop: int,
    tiers: TierConfig | None,
    rng: NoiseRng,
) -> NoiseMechanism:
    """The shard [start, stop) of the mechanism's streaming noise (`dp.noise_factory`),
    its rows (b-1 ring slots, or d BLT buffers) placed over the tiers `tiers` allows."""
    rows = build_history(noise_rows(mechanism), stop - start, dtype, tiers)
    return noise_for(
        mechanism, dim, key, noise_std, dtype, start=start, stop=stop, rows=rows, rng=rng
    )


def tables_mechanism(mechanism: Mechanism) -> BandMF:
    """The BandMF strategy embedding tables run (`check_mechanism` has refused a BLT
    with tables).

    Raises:
        ConfigError: `mechanism` is a BLT.
    """
    if isinstance(mechanism, BLT):
        raise ConfigError(
            "embedding tables run BandMF's coalesced noise in this release, not a BLT: "
            "use a banded mechanism, or drop EmbeddingConfig"
        )
    return mechanism


def build_accountant(config: DPConfig, mechanism: Mechanism) -> Accountant:
    """The run's accountant: amplified BandMF, or a BLT's one Gaussian at its min-sep
    sensitivity (keyed by the mechanism, recorded as `sensitivity`)."""
    return Accountant(
        noise_multiplier=config.sigma,
        dataset_size=config.dataset_size,
        batch_size=config.batch_size,
        bands=config.bands,
        delta=config.delta,
        method=str(config.accountant),
        sensitivity=blt_sensitivity(config, mechanism),
    )
