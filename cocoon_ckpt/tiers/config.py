"""TierConfig: which tiers a job's noise history may use, and how to split it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.base import GemvMode

__all__ = ["TierConfig"]

TIER_NAMES = ("device", "host", "far")


@dataclass(frozen=True, kw_only=True, slots=True)
class TierConfig:
    """Where the ring history may live. Changing it never changes the noise (the GEMV
    kernel has one order of rounding and fresh noise is keyed by block), so a resume may
    give other tiers: the history is re-planned and moved, bit for bit the same.

    Attributes:
        device_bytes: Device memory for history plus the merge buffer, bytes. 0: no device tier;
            None: half of what is free (CUDA), or an eighth of free host memory on a CPU-only
            machine, where the device tier is emulated by torch on the CPU.
        host_bytes: Host DRAM for history, bytes. None: half of the free memory. 0: no host tier.
        far_bytes: Far (emulated CXL) memory for history, bytes. 0: no far tier; None: 90% of the
            free space in `far_dir`.
        far_dir: Folder of the far tier's memory-mapped file (tmpfs emulates memory, a disk
            capacity). Default: the system temp folder.
        far_link_bytes_per_s: Model the far link at this bandwidth, bytes/s (None: no throttle).
        mode: Where the GEMV runs: near the data (Cocoon), or a baseline pulling everything to the
            device (GPU-GEMV) or to the host (CPU-GEMV).
        unit_blocks: Allocation unit, in 65,536-coordinate noise blocks.
        counts: A fixed split, units per tier name (device, host, far), instead of profiling.
        profile_reps: GEMV repetitions per tier in the profile (the median is used).
        device: torch device of the device tier (default: cuda when present, else cpu).
    """

    device_bytes: int | None = 0
    host_bytes: int | None = None
    far_bytes: int | None = 0
    far_dir: str | None = None
    far_link_bytes_per_s: float | None = None
    mode: GemvMode = GemvMode.NEAR_DATA
    unit_blocks: int = 1
    counts: dict[str, int] | None = None
    profile_reps: int = 3
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("device_bytes", "host_bytes", "far_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"TierConfig.{name}={v!r}: must be an integer >= 0 or None")
        if self.far_link_bytes_per_s is not None and not self.far_link_bytes_per_s > 0:
            raise ConfigError(
                f"TierConfig.far_link_bytes_per_s={self.far_link_bytes_per_s!r}: must be > 0 "
                "or None"
            )
        if not isinstance(self.unit_blocks, int) or self.unit_blocks < 1:
            raise ConfigError(f"TierConfig.unit_blocks={self.unit_blocks!r}: must be >= 1")
        if self.profile_reps < 1:
            raise ConfigError(f"TierConfig.profile_reps={self.profile_reps!r}: must be >= 1")
        if self.counts is not None:
            bad = set(self.counts) - set(TIER_NAMES)
            if bad or any(not isinstance(n, int) or n < 0 for n in self.counts.values()):
                raise ConfigError(
                    f"TierConfig.counts={self.counts!r}: must map tier names {TIER_NAMES} "
                    "to unit counts >= 0"
                )
        object.__setattr__(self, "mode", GemvMode(self.mode))

    def to_record(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mode"] = self.mode.value
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> TierConfig:
        return cls(**d)
