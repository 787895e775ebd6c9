"""Job configuration: `DPConfig` (the privacy-relevant part) and `JobConfig` (the whole
job), read from and written to config records. The fingerprint and the resume check
live in `format.fingerprint` and are importable from here."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.dp.accounting.method import AccountingMethod
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.format.fingerprint import (
    HARMLESS_FIELDS,
    HARMLESS_SECTIONS,
    check_resume,
    config_differences,
    fingerprint,
)
from cocoon_ckpt.tiers.config import TierConfig

if TYPE_CHECKING:
    from cocoon_ckpt.dp.generator import NoiseRng

__all__ = [
    "ACCOUNTANTS",
    "CLIPPINGS",
    "HARMLESS_FIELDS",
    "HARMLESS_SECTIONS",
    "MAX_LR",
    "MIN_LEASE_EXPIRY_S",
    "NOISE_RNGS",
    "OPTIMIZERS",
    "DPConfig",
    "JobConfig",
    "check_resume",
    "config_differences",
    "fingerprint",
    "section_from_record",
]

_S = TypeVar("_S")

#: The kinds a config can ask for (`custom` coefficients have no place in a config:
#: build `BandMF` yourself).
_MECHANISMS = tuple(m.value for m in MechanismKind if m is not MechanismKind.CUSTOM)
#: `DPConfig.accountant`'s values.
ACCOUNTANTS = tuple(m.value for m in AccountingMethod)
_LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")

#: `JobConfig.optimizer`'s values: the torch.optim optimizers by class name in lower case
#: (spelled out: the config is read without importing torch), and `custom` for a class
#: of the job's own.
OPTIMIZERS = (
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "asgd",
    "lbfgs",
    "muon",
    "nadam",
    "radam",
    "rmsprop",
    "rprop",
    "sgd",
    "sparseadam",
    "custom",
)
#: `NoiseRng`'s values (dp.generator imports torch; the config is read without it).
NOISE_RNGS = ("default", "secure")
#: `DPConfig.clipping`'s values: per-sample gradients by vmap (`train.grads`), or ghost
#: norms and book-keeping from activations and output gradients (`train.ghost`).
CLIPPINGS = ("vmap", "ghost")

#: The largest `JobConfig.lr`: no optimizer trains at a larger rate (`--lr 1e308` failed at
#: the first optimizer step, after the store was written: torch cannot convert it to a
#: float32 parameter's type).
MAX_LR = 1e6
#: The shortest `JobConfig.lease_expiry_s`. The holder renews every third of it (1.7 s
#: here), time for a renewal on a busy object store (a PUT can take hundreds of ms) to land
#: before the lease looks dead to another host; at 1e-9 s the heartbeat spun.
MIN_LEASE_EXPIRY_S = 5.0


@dataclass(frozen=True, kw_only=True, slots=True)
class DPConfig:
    """The privacy-relevant configuration of a run.

    Attributes:
        steps: n, total training steps.
        batch_size: B, expected batch size (Poisson sampling).
        dataset_size: N, examples in the training set.
        noise_multiplier: sigma: fresh noise std is sigma * max_grad_norm, in [0.3, 1e8]
            (`dp._validate.SIGMA_MIN`, `SIGMA_MAX`: below, the accountant's composition grows
            without bound and the epsilon is no real privacy; above, the noise is more than any
            job needs). Give it or `target_epsilon`, not both; with a target it is None until the
            job's start calibrates it (`sigma` reads it either way).
        target_epsilon: The epsilon at `delta` the whole job (`steps` steps) must stay within: sigma
            is calibrated once at job start (the smallest sigma >= 0.3 that meets it under
            `accountant`; a target that needs sigma above 1e8 is refused) and recorded beside it, so every resume reuses it. A calibrated config
            (and its record) carries both fields.
        accountant: How epsilon is composed (`pld`: tight; `rdp`: looser), for the calibration and
            the reported epsilon. Fingerprinted only with `target_epsilon`, where it chose sigma;
            otherwise it changes the reported epsilon only, and a resume may change it.
        max_grad_norm: Per-sample clipping norm (L2).
        bands: b, BandMF bands (1 = DP-SGD): the sampler's partitions, so each example's steps are
            at least b apart (a BLT's min-sep).
        delta: Target delta of the reported epsilon.
        mechanism: How the band coefficients are chosen (`optimized`: the least expected error for
            these bands and steps; banded_sqrt's is 6-34% higher for b in 2..64), or `blt`: a
            buffered linear Toeplitz strategy fitted for `steps` with `bands` as its min-sep,
            accounted without amplification (`cocoon_ckpt.dp.blt.accounting`).
        seed: Sampler and model-initialisation seed (not the noise key, which is secret).
        physical_batch_size: Most examples whose per-sample gradients are taken at once (peak memory
            follows it, not the Poisson batch); None: the whole batch at once. The sums of different
            chunk sizes differ in the last bits, so it is part of the fingerprint.
        noise_rng: Which generator draws the fresh noise (`cocoon_ckpt.dp.generator.NoiseRng`, or
            its value): `default` (numpy SFC64) or `secure` (ChaCha20). Kept as its value.
        clipping: How the clipped per-sample gradient sum is taken (`CLIPPINGS`): `vmap`
            forms each chunk's per-sample gradients (`train.grads`); `ghost` forms none for
            nn.Linear, nn.LayerNorm and nn.Embedding, taking their per-sample norms from
            activations and output gradients, and the clipped sum from the same (one backward:
            `train.ghost`; other layers take per-sample gradients of their own
            parameters). The two agree to float rounding, not bit for bit: fingerprinted.
    """

    steps: int
    batch_size: int
    dataset_size: int
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    accountant: AccountingMethod | str = AccountingMethod.PLD
    max_grad_norm: float = 1.0
    bands: int = 1
    delta: float = 1e-5
    mechanism: MechanismKind = MechanismKind.OPTIMIZED
    seed: int = 0
    physical_batch_size: int | None = None
    noise_rng: NoiseRng | str = "default"
    clipping: str = "vmap"
    calibrated: InitVar[bool] = False
    """Not a field: True lets `noise_multiplier` and `target_epsilon` both be given, as a
    calibrated config carries them (`from_record` passes it for a record holding both)."""

    def __post_init__(self, calibrated: bool) -> None:
        valid.integer("DPConfig.steps", self.steps, 1, valid.MAX_STEPS)
        valid.integer("DPConfig.bands", self.bands, 1, valid.MAX_STEPS)
        valid.check(
            self.bands <= self.steps, "DPConfig.bands", self.bands, f"be <= steps={self.steps}"
        )
        valid.integer("DPConfig.dataset_size", self.dataset_size, 1, valid.MAX_COUNT)
        valid.integer("DPConfig.batch_size", self.batch_size, 1, valid.MAX_COUNT)
        valid.check(
            self.batch_size * self.bands <= self.dataset_size,
            "DPConfig.batch_size",
            self.batch_size,
            f"satisfy batch_size * bands <= dataset_size={self.dataset_size} (bands="
            f"{self.bands}: the data is split into b partitions of N / b examples)",
        )
        self._check_noise(calibrated)
        valid.positive_real("DPConfig.max_grad_norm", self.max_grad_norm)
        valid.real_between("DPConfig.delta", self.delta, 0.0, 1.0)
        # seed + 1 seeds the examples' data; numpy wants a non-negative seed
        valid.integer("DPConfig.seed", self.seed, 0, 2**63 - 2)
        valid.check(
            self.mechanism in _MECHANISMS,
            "DPConfig.mechanism",
            self.mechanism,
            f"be one of {_MECHANISMS}",
        )
        object.__setattr__(self, "mechanism", MechanismKind(self.mechanism))
        valid.check(
            self.mechanism is not MechanismKind.BLT or self.steps >= 2,
            "DPConfig.steps",
            self.steps,
            "be >= 2 with mechanism='blt' (a one-step run is DP-SGD: use bands=1)",
        )
        if self.physical_batch_size is not None:
            valid.integer(
                "DPConfig.physical_batch_size", self.physical_batch_size, 1, valid.MAX_COUNT
            )
        valid.text("DPConfig.noise_rng", self.noise_rng, NOISE_RNGS)
        object.__setattr__(self, "noise_rng", str(self.noise_rng))
        valid.text("DPConfig.clipping", self.clipping, CLIPPINGS)

    def _check_noise(self, calibrated: bool) -> None:
        """Exactly one of sigma and the target, unless calibrated (both); the accountant."""
        sigma, target = self.noise_multiplier, self.target_epsilon
        if sigma is None and target is None:
            raise ConfigError(
                "DPConfig: missing field noise_multiplier (sigma) or target_epsilon (the "
                "epsilon to calibrate sigma for); give one of the two"
            )
        if sigma is not None:
            valid.noise_multiplier("DPConfig.noise_multiplier", sigma)
        if target is not None:
            valid.positive_real("DPConfig.target_epsilon", target)
        valid.check(
            sigma is None or target is None or calibrated,
            "DPConfig.noise_multiplier",
            sigma,
            f"be None when target_epsilon={target} is given: sigma is calibrated for the "
            "target at job start; give one of the two",
        )
        valid.check(
            not calibrated or (sigma is not None and target is not None),
            "DPConfig.calibrated",
            calibrated,
            f"come with both noise_multiplier and target_epsilon (noise_multiplier={sigma}, "
            f"target_epsilon={target})",
        )
        valid.text("DPConfig.accountant", self.accountant, ACCOUNTANTS)
        object.__setattr__(self, "accountant", AccountingMethod(self.accountant))

    @property
    def sigma(self) -> float:
        """The noise multiplier that runs: given, or calibrated for `target_epsilon`.

        Raises:
            ConfigError: `target_epsilon` is given and not calibrated yet.
        """
        if self.noise_multiplier is None:
            raise ConfigError(
                f"DPConfig.target_epsilon={self.target_epsilon} is not calibrated yet, so "
                "there is no noise_multiplier: open the job with open_job or run_job (they "
                "calibrate it once and record it), or pass the config through "
                "cocoon_ckpt.train.target_epsilon.calibrated_job first"
            )
        return self.noise_multiplier

    @property
    def is_calibrated(self) -> bool:
        """sigma was calibrated for `target_epsilon` (the config carries both)."""
        return self.target_epsilon is not None and self.noise_multiplier is not None

    def to_record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mechanism"] = self.mechanism.value
        d["noise_rng"] = str(self.noise_rng)
        d["accountant"] = str(self.accountant)
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> DPConfig:
        """The config a record describes (ConfigError naming a missing or unknown field).

        A record that holds both `noise_multiplier` and `target_epsilon` is a calibrated
        config's: it is read as one, never recalibrated."""
        d = _fields(cls, d, "dp")
        both = d.get("noise_multiplier") is not None and d.get("target_epsilon") is not None
        return cls(**d, calibrated=both)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A whole job: what to train, how privately, how often to checkpoint.

    Attributes:
        job: What to train: `example:mlp`, `example:dlrm` or a `module:function` path.
        dp: The privacy configuration.
        lr: Learning rate of the job's optimizer (its first param group's, before any scheduler
            step), in (0, 1e6] (`MAX_LR`). The job must build its optimizer with it: a job whose optimizer runs another is
            refused at build, so the recorded config says what ran.
        optimizer: The job's optimizer: a `torch.optim` class name in lower case (`sgd`, `adam`,
            `adamw`, ...; `OPTIMIZERS`), or `custom` for a class of the job's own (its class and
            hyperparameters are recorded from the object). Checked like `lr`.
        options: Job-specific options (model sizes, ...); part of the fingerprint.
        checkpoint_every: Steps between checkpoints (harmless to change on resume).
        keep_last: Versions retention keeps (harmless).
        async_checkpoint: Write checkpoints in a background thread (harmless).
        log_level: Logging level (harmless).
        lease_expiry_s: Seconds after its last renewal that the writer lease of a holder on another
            host counts as dead, so a job restarted elsewhere resumes without takeover; the holder
            renews it every third of that (harmless). In [5, 86400] (`MIN_LEASE_EXPIRY_S`).
        tiers: Where the noise history lives (device, host, far); None: all on the host (harmless:
            the noise is bit-identical on any tiers).
        overlap_noise: Compute w_t in a worker thread while the per-sample gradients are taken
            (harmless: bit-identical either way).
        grad_threads: torch intra-op threads the per-sample gradients, clipping and optimizer step
            run at (`train.grad_threads`); None: when a new job starts, 1 below 2^18 dense
            parameters, torch's count from there (`default_grad_threads`). The count is
            recorded in every version and a resume runs at it on any machine (another explicit count
            is refused there), so it is not part of the fingerprint.
        embedding: Noise for sparse embedding tables (`cocoon_ckpt.embedding`); None: every
            parameter, tables included, gets the dense mechanism over one flat vector.
    """

    job: str
    dp: DPConfig
    lr: float = 0.1
    optimizer: str = "sgd"
    options: dict[str, Any] = field(default_factory=dict)
    checkpoint_every: int = 10
    keep_last: int = 3
    async_checkpoint: bool = True
    log_level: str = "WARNING"
    lease_expiry_s: float = 60.0
    tiers: TierConfig | None = None
    overlap_noise: bool = False
    grad_threads: int | None = None
    embedding: EmbeddingConfig | None = None

    def __post_init__(self) -> None:
        valid.text("JobConfig.job", self.job)
        valid.check(
            ":" in self.job,
            "JobConfig.job",
            self.job,
            "be 'example:NAME' or 'module:function'",
        )
        valid.check(isinstance(self.dp, DPConfig), "JobConfig.dp", self.dp, "be a DPConfig")
        valid.positive_real("JobConfig.lr", self.lr)
        valid.check(
            self.lr <= MAX_LR,
            "JobConfig.lr",
            self.lr,
            f"be at most {MAX_LR:g}: no optimizer trains at a larger rate, and above float32's "
            "3.4e38 torch cannot even apply it to a float32 parameter",
        )
        valid.text("JobConfig.optimizer", self.optimizer, OPTIMIZERS)
        valid.check(
            isinstance(self.options, dict) and all(isinstance(k, str) for k in self.options),
            "JobConfig.options",
            self.options,
            "be a JSON object (a dict with string keys)",
        )
        valid.integer("JobConfig.checkpoint_every", self.checkpoint_every, 1, valid.MAX_STEPS)
        valid.integer("JobConfig.keep_last", self.keep_last, 2, valid.MAX_COUNT)
        valid.boolean("JobConfig.async_checkpoint", self.async_checkpoint)
        valid.boolean("JobConfig.overlap_noise", self.overlap_noise)
        if self.grad_threads is not None:
            valid.integer("JobConfig.grad_threads", self.grad_threads, 1, 4096)
        valid.positive_real("JobConfig.lease_expiry_s", self.lease_expiry_s)
        valid.check(
            self.lease_expiry_s >= MIN_LEASE_EXPIRY_S,
            "JobConfig.lease_expiry_s",
            self.lease_expiry_s,
            f"be at least {MIN_LEASE_EXPIRY_S:g} seconds (--lease-expiry): the holder renews "
            "its lease every third of it, and a shorter one loses the lease to a slow renewal "
            "or spins renewing it",
        )
        valid.check(
            self.lease_expiry_s <= 86400,
            "JobConfig.lease_expiry_s",
            self.lease_expiry_s,
            "be at most 86400 (a day): a dead holder's lease would block resumes that long",
        )
        valid.text("JobConfig.log_level", self.log_level)
        valid.check(
            self.log_level.upper() in _LOG_LEVELS,
            "JobConfig.log_level",
            self.log_level,
            f"be one of {_LOG_LEVELS}",
        )
        valid.check(
            self.tiers is None or isinstance(self.tiers, TierConfig),
            "JobConfig.tiers",
            self.tiers,
            "be a TierConfig or None",
        )
        valid.check(
            self.embedding is None or isinstance(self.embedding, EmbeddingConfig),
            "JobConfig.embedding",
            self.embedding,
            "be an EmbeddingConfig or None",
        )
        valid.check(
            self.embedding is None or self.dp.mechanism is not MechanismKind.BLT,
            "JobConfig.embedding",
            self.embedding,
            "be None with mechanism='blt' (coalesced table noise is BandMF's in this "
            "release): use a banded mechanism for an embedding job",
        )

    def to_record(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["dp"] = self.dp.to_record()
        d["options"] = dict(self.options)
        d["tiers"] = self.tiers.to_record() if self.tiers is not None else None
        d["embedding"] = self.embedding.to_record() if self.embedding is not None else None
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> JobConfig:
        """The config a record describes (a JSON object as `to_record` writes it).

        Raises:
            ConfigError: a field is missing, unknown, of the wrong type or out of range.
        """
        d = _fields(cls, d, "config")
        d["dp"] = DPConfig.from_record(d["dp"])
        if d.get("tiers") is not None:
            d["tiers"] = section_from_record(TierConfig, d["tiers"], "tiers")
        if d.get("embedding") is not None:
            d["embedding"] = section_from_record(EmbeddingConfig, d["embedding"], "embedding")
        return cls(**d)


def section_from_record(cls: type[_S], record: Any, where: str) -> _S:
    """A TierConfig or EmbeddingConfig from its JSON record; `where` names it in errors.

    Raises:
        ConfigError: the record is not an object, has an unknown or missing field, or a
            value its class refuses.
    """
    d = _fields(cls, record, where)
    try:
        return cls.from_record(d)  # type: ignore[attr-defined, no-any-return]
    except ConfigError:
        raise
    except (TypeError, KeyError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _fields(cls: type, d: Any, where: str) -> dict[str, Any]:
    """`d` as keyword arguments of dataclass `cls`: a JSON object with every required
    field and no unknown one."""
    valid.check(isinstance(d, dict), where, d, "be a JSON object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(map(str, unknown))}; the fields are "
            f"those of {cls.__name__}: {', '.join(fields)}"
        )
    missing = [
        n
        for n, f in fields.items()
        if n not in d
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)} of {cls.__name__}")
    return dict(d)
