"""Job configuration, its fingerprint, and the resume compatibility check."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from .embedding.config import EmbeddingConfig
from .errors import ConfigMismatchError
from .mechanism import MechanismKind
from .tiers.config import TierConfig

__all__ = ["HARMLESS_FIELDS", "DPConfig", "JobConfig", "config_differences", "fingerprint"]

#: Fields a resume may change: they affect neither the noise nor the parameters.
HARMLESS_FIELDS = frozenset(
    {"checkpoint_every", "keep_last", "async_checkpoint", "log_level", "tile_rows", "overlap_noise"}
)
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
    mechanism: MechanismKind = MechanismKind.BANDED_SQRT
    """How the band coefficients are chosen."""
    seed: int = 0
    """Sampler and model-initialisation seed (not the noise key, which is secret)."""

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"DPConfig.{name}={getattr(self, name)!r}: {why}")

        need(isinstance(self.steps, int) and self.steps >= 1, "steps", "must be an integer >= 1")
        need(isinstance(self.bands, int) and self.bands >= 1, "bands", "must be an integer >= 1")
        need(self.bands <= self.steps, "bands", f"must be <= steps={self.steps}")
        need(
            isinstance(self.batch_size, int) and self.batch_size >= 1, "batch_size", "must be >= 1"
        )
        need(
            isinstance(self.dataset_size, int) and self.dataset_size >= 1,
            "dataset_size",
            "must be >= 1",
        )
        need(
            self.batch_size * self.bands <= self.dataset_size,
            "batch_size",
            f"batch_size * bands must be <= dataset_size={self.dataset_size}",
        )
        need(
            self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier),
            "noise_multiplier",
            "must be finite and > 0",
        )
        need(
            self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm),
            "max_grad_norm",
            "must be finite and > 0",
        )
        need(0 < self.delta < 1, "delta", "must lie in (0, 1)")
        object.__setattr__(self, "mechanism", MechanismKind(self.mechanism))

    def to_record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mechanism"] = self.mechanism.value
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> DPConfig:
        return cls(**d)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """A whole job: what to train, how privately, how often to checkpoint."""

    job: str
    """What to train: `example:mlp`, `example:dlrm` or a `module:function` path."""
    dp: DPConfig
    """The privacy configuration."""
    lr: float = 0.1
    """Learning rate."""
    optimizer: str = "sgd"
    """`sgd` or `adam`."""
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
        if self.optimizer not in ("sgd", "adam"):
            raise ValueError(f"JobConfig.optimizer={self.optimizer!r}: must be 'sgd' or 'adam'")
        if not self.lr > 0:
            raise ValueError(f"JobConfig.lr={self.lr!r}: must be > 0")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1:
            raise ValueError(f"JobConfig.checkpoint_every={self.checkpoint_every!r}: must be >= 1")
        if self.keep_last < 2:
            raise ValueError(f"JobConfig.keep_last={self.keep_last!r}: must be >= 2")
        if ":" not in self.job:
            raise ValueError(
                f"JobConfig.job={self.job!r}: must be 'example:NAME' or 'module:function'"
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
        d = dict(d)
        d["dp"] = DPConfig.from_record(d["dp"])
        if d.get("tiers") is not None:
            d["tiers"] = TierConfig.from_record(d["tiers"])
        if d.get("embedding") is not None:
            d["embedding"] = EmbeddingConfig.from_record(d["embedding"])
        return cls(**d)


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


#: Sections added after the first release: absent from older records, the same as None.
_OPTIONAL_SECTIONS = frozenset({"embedding"})


def _relevant(record: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in _flat(record).items()
        if k.split(".")[-1] not in HARMLESS_FIELDS
        and k.split(".")[0] not in HARMLESS_SECTIONS
        and not (k in _OPTIONAL_SECTIONS and v is None)
    }


def fingerprint(record: dict[str, Any], model_shapes: dict[str, list[int]]) -> str:
    """sha256 over the fields that change the noise or the parameters, and the shapes."""
    doc = {"config": _relevant(record), "model_shapes": model_shapes}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def config_differences(
    stored: dict[str, Any],
    now: dict[str, Any],
    stored_shapes: dict[str, list[int]] | None = None,
    now_shapes: dict[str, list[int]] | None = None,
) -> list[str]:
    """One line per noise- or result-affecting difference between two config records."""
    a, b = _relevant(stored), _relevant(now)
    diffs = [
        f"{k}: stored {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
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
