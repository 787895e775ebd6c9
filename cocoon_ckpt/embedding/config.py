"""How embedding tables get their noise: which parameters are tables, where their ids
are, and which path (dense online, coalesced with a hot/cold split, lazy at b = 1)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from cocoon_ckpt.errors import ConfigError

__all__ = ["EmbeddingConfig", "TableMode", "TableSpec"]


class TableMode(enum.StrEnum):
    """The noise path of a table. Every path adds noise from the same keyed source."""

    AUTO = "auto"
    """Pick from a quick profile: COALESCED where it is faster than DENSE, LAZY at b = 1
    (both only under threat_model="final_model"), else DENSE."""
    DENSE = "dense"
    """Online BandMF over every row, every step: private against an adversary who sees
    every intermediate model."""
    COALESCED = "coalesced"
    """Hot rows online; the noise a cold row receives between two of its reads is
    precomputed and applied as one entry just before the next read (CSC). Only the
    final model carries full noise (threat_model="final_model"); exact for SGD."""
    LAZY = "lazy"
    """b = 1 only: the k steps of noise a row misses between reads are drawn as one
    Gaussian of k times the variance when it is next read. Equal to per-step DP-SGD
    noise in distribution, not in value; threat_model="final_model"; SGD only."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TableSpec:
    """One embedding table: an nn.Embedding weight read with one id per example."""

    param: str
    """The table's parameter name in the model, e.g. `tables.0.weight`."""
    data_index: int
    """Which data tensor holds this table's ids (the target is the last tensor)."""
    column: int
    """The column of that (N, columns) int tensor holding the ids."""

    def __post_init__(self) -> None:
        if not self.param:
            raise ConfigError("TableSpec.param='': name the table's parameter, e.g. 'emb.weight'")
        if self.data_index < 0 or self.column < 0:
            raise ConfigError(
                f"TableSpec for {self.param}: data_index={self.data_index}, "
                f"column={self.column} must be >= 0"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class EmbeddingConfig:
    """Noise for sparse embedding tables (`cocoon_ckpt.embedding`).

    Attributes:
        tables: The tables; every other trainable parameter gets the dense mechanism. Empty: the
            tables the job declares (`JobParts.tables`).
        mode: The noise path of every table (COALESCED and LAZY need final_model).
        threat_model: `intermediate_iterates` (every checkpoint private; tables stay DENSE) or
            `final_model` (only the exported final model is private; allows coalescing).
        hot_threshold: A row read more than this many times is hot (online history); None: chosen
            from a quick profile to minimise the step time.
        tile_rows: Rows per precompute tile; None: as many as keep a tile's history near 8 MiB.
        lr_schedule: The SGD learning rate of every step (length = steps); None: the optimizer's
            constant learning rate. A coalesced table's entries are precomputed with it.
        csc_window_steps: Read each coalesced table's committed CSC from the store in windows of
            this many steps, the next one prefetched (at most two in memory); None: hold the
            whole CSC in memory. The same bits either way, so a resume may change it (not
            fingerprinted).
    """

    tables: tuple[TableSpec, ...] = ()
    mode: TableMode = TableMode.AUTO
    threat_model: str = "intermediate_iterates"
    hot_threshold: int | None = None
    tile_rows: int | None = None
    lr_schedule: tuple[float, ...] | None = None
    csc_window_steps: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", tuple(self.tables))
        object.__setattr__(self, "mode", TableMode(self.mode))
        names = [t.param for t in self.tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"EmbeddingConfig.tables names a parameter twice: {names}")
        if self.threat_model not in ("intermediate_iterates", "final_model"):
            raise ConfigError(
                f"EmbeddingConfig.threat_model={self.threat_model!r}: must be "
                "'intermediate_iterates' or 'final_model'"
            )
        if (
            self.mode in (TableMode.COALESCED, TableMode.LAZY)
            and self.threat_model != "final_model"
        ):
            raise ConfigError(
                f"EmbeddingConfig.mode={self.mode.value!r} needs threat_model='final_model': "
                "intermediate checkpoints would not carry the full noise of cold rows. "
                "Set threat_model='final_model' (only the final model may be released) or "
                "use mode='dense'"
            )
        if self.hot_threshold is not None and self.hot_threshold < 0:
            raise ConfigError(f"EmbeddingConfig.hot_threshold={self.hot_threshold}: must be >= 0")
        if self.tile_rows is not None and self.tile_rows < 1:
            raise ConfigError(f"EmbeddingConfig.tile_rows={self.tile_rows}: must be >= 1")
        if self.csc_window_steps is not None and self.csc_window_steps < 1:
            raise ConfigError(
                f"EmbeddingConfig.csc_window_steps={self.csc_window_steps}: give 1 or more "
                "steps per window, or None to hold the whole CSC in memory"
            )
        if self.lr_schedule is not None:
            lrs = tuple(float(x) for x in self.lr_schedule)
            if not all(math.isfinite(x) and x >= 0 for x in lrs):
                raise ConfigError("EmbeddingConfig.lr_schedule: every rate must be finite, >= 0")
            object.__setattr__(self, "lr_schedule", lrs)

    @property
    def coalescing_allowed(self) -> bool:
        return self.threat_model == "final_model"

    def to_record(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tables"] = [dataclasses.asdict(t) for t in self.tables]
        d["mode"] = self.mode.value
        d["lr_schedule"] = list(self.lr_schedule) if self.lr_schedule is not None else None
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> EmbeddingConfig:
        d = dict(d)
        d["tables"] = tuple(TableSpec(**t) for t in d["tables"])
        if d.get("lr_schedule") is not None:
            d["lr_schedule"] = tuple(d["lr_schedule"])
        return cls(**d)
