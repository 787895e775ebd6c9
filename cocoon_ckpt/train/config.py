"""Job configuration, its fingerprint, and the resume compatibility check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from cocoon_ckpt.dp import _validate as valid
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.embedding.config import EmbeddingConfig
from cocoon_ckpt.errors import ConfigError, ConfigMismatchError
from cocoon_ckpt.tiers.config import TierConfig

if TYPE_CHECKING:
    from cocoon_ckpt.dp.generator import NoiseRng

__all__ = [
    "HARMLESS_FIELDS",
    "NOISE_RNGS",
    "OPTIMIZERS",
    "DPConfig",
    "JobConfig",
    "config_differences",
    "fingerprint",
    "section_from_record",
]

_S = TypeVar("_S")

#: Fields a resume may change: they affect neither the noise nor the parameters.
HARMLESS_FIELDS = frozenset(
    {
        "checkpoint_every",
        "keep_last",
        "async_checkpoint",
        "log_level",
        "tile_rows",
        "overlap_noise",
        "lease_expiry_s",
    }
)
_MECHANISMS = tuple(m.value for m in MechanismKind)
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

#: Whole sections a resume may change: where the history lives never changes the noise.
HARMLESS_SECTIONS = frozenset({"tiers"})


@dataclass(frozen=True, kw_only=True, slots=True)
class DPConfig:
    """The privacy-relevant configuration of a run."""

    steps: int
    """n, total training steps."""
    batch_size: int
    """B, expected batch size (Poisson sampling)."""
    dataset_size: int
    """N, examples in the training set."""
    noise_multiplier: float
    """sigma: fresh noise std is sigma * max_grad_norm."""
    max_grad_norm: float = 1.0
    """Per-sample clipping norm (L2)."""
    bands: int = 1
    """b, BandMF bands (1 = DP-SGD)."""
    delta: float = 1e-5
    """Target delta of the reported epsilon."""
    mechanism: MechanismKind = MechanismKind.OPTIMIZED
    """How the band coefficients are chosen (`optimized`: the least expected error for
    these bands and steps; banded_sqrt's is 6-34% higher for b in 2..64)."""
    seed: int = 0
    """Sampler and model-initialisation seed (not the noise key, which is secret)."""
    physical_batch_size: int | None = None
    """Most examples whose per-sample gradients are taken at once (peak memory follows
    it, not the Poisson batch); None: the whole batch at once. The sums of different
    chunk sizes differ in the last bits, so it is part of the fingerprint."""
    noise_rng: NoiseRng | str = "default"
    """Which generator draws the fresh noise (`cocoon_ckpt.dp.generator.NoiseRng`, or
    its value): `default` (numpy SFC64) or `secure` (ChaCha20). Kept as its value."""

    def __post_init__(self) -> None:
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
        valid.positive_real("DPConfig.noise_multiplier", self.noise_multiplier)
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
        if self.physical_batch_size is not None:
            valid.integer(
                "DPConfig.physical_batch_size", self.physical_batch_size, 1, valid.MAX_COUNT
            )
        valid.text("DPConfig.noise_rng", self.noise_rng, NOISE_RNGS)
        object.__setattr__(self, "noise_rng", str(self.noise_rng))

    def to_record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mechanism"] = self.mechanism.value
        d["noise_rng"] = str(self.noise_rng)
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> DPConfig:
        """The config a record describes (ConfigError naming a missing or unknown field)."""
        return cls(**_fields(cls, d, "dp"))


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A whole job: what to train, how privately, how often to checkpoint."""

    job: str
    """What to train: `example:mlp`, `example:dlrm` or a `module:function` path."""
    dp: DPConfig
    """The privacy configuration."""
    lr: float = 0.1
    """Learning rate of the job's optimizer (its first param group's, before any
    scheduler step). The job must build its optimizer with it: a job whose optimizer
    runs another is refused at build, so the recorded config says what ran."""
    optimizer: str = "sgd"
    """The job's optimizer: a `torch.optim` class name in lower case (`sgd`, `adam`,
    `adamw`, ...; `OPTIMIZERS`), or `custom` for a class of the job's own (its class and
    hyperparameters are recorded from the object). Checked like `lr`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Job-specific options (model sizes, ...); part of the fingerprint."""
    checkpoint_every: int = 10
    """Steps between checkpoints (harmless to change on resume)."""
    keep_last: int = 3
    """Versions retention keeps (harmless)."""
    async_checkpoint: bool = True
    """Write checkpoints in a background thread (harmless)."""
    log_level: str = "WARNING"
    """Logging level (harmless)."""
    lease_expiry_s: float = 60.0
    """Seconds after its last renewal that the writer lease of a holder on another host
    counts as dead, so a job restarted elsewhere resumes without takeover; the holder
    renews it every third of that (harmless)."""
    tiers: TierConfig | None = None
    """Where the noise history lives (device, host, far); None: all on the host
    (harmless: the noise is bit-identical on any tiers)."""
    overlap_noise: bool = False
    """Compute w_t in a worker thread while the per-sample gradients are taken (harmless:
    bit-identical either way)."""
    embedding: EmbeddingConfig | None = None
    """Noise for sparse embedding tables (`cocoon_ckpt.embedding`); None: every
    parameter, tables included, gets the dense mechanism over one flat vector."""

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
        valid.positive_real("JobConfig.lease_expiry_s", self.lease_expiry_s)
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


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: Sections and fields added after the first release, with the value their absence from
#: an older record means: at that value they are left out, so older stores keep their
#: fingerprints and resume.
_ADDED = {"embedding": None, "dp.physical_batch_size": None, "dp.noise_rng": "default"}


def _relevant(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in _flat(record).items()
        if k.split(".")[-1] not in HARMLESS_FIELDS
        and k.split(".")[0] not in HARMLESS_SECTIONS
        and not (k in _ADDED and v == _ADDED[k])
    }


def fingerprint(
    record: dict[str, Any],
    model_shapes: dict[str, list[int]],
    identity: dict[str, Any] | None = None,
) -> str:
    """sha256 over the fields that change the noise or the parameters, the shapes, and
    (given) the job's identity from its real objects (`train.identity`: optimizer,
    scheduler, dataset); without it, the fingerprint of stores written before it."""
    doc: dict[str, Any] = {"config": _relevant(record), "model_shapes": model_shapes}
    if identity is not None:
        doc["identity"] = identity
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _shown(relevant: dict[str, Any], k: str) -> Any:
    """A field's value in a difference: an added field left out means its default."""
    return relevant.get(k, _ADDED[k] if k in _ADDED else "<absent>")


def config_differences(
    stored: dict[str, Any],
    now: dict[str, Any],
    stored_shapes: dict[str, list[int]] | None = None,
    now_shapes: dict[str, list[int]] | None = None,
) -> list[str]:
    """One line per noise- or result-affecting difference between two config records."""
    a, b = _relevant(stored), _relevant(now)
    diffs = [
        f"{k}: stored {_shown(a, k)!r}, now {_shown(b, k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    if stored_shapes is not None and now_shapes is not None and stored_shapes != now_shapes:
        for k in sorted(set(stored_shapes) | set(now_shapes)):
            if stored_shapes.get(k) != now_shapes.get(k):
                diffs.append(
                    f"model shape {k}: stored {stored_shapes.get(k)}, now {now_shapes.get(k)}"
                )
    return diffs


def check_resume(
    stored: dict[str, Any],
    now: dict[str, Any],
    stored_shapes: dict[str, list[int]],
    now_shapes: dict[str, list[int]],
    where: str,
) -> None:
    """Raise ConfigMismatchError listing every difference that would change the noise."""
    diffs = config_differences(stored, now, stored_shapes, now_shapes)
    if diffs:
        raise ConfigMismatchError(
            f"{where} was written by a job with another configuration; resuming would add "
            "different noise. Differences: " + "; ".join(diffs) + ". Use the stored "
            "configuration, or a new store for the new job",
            diffs,
        )
