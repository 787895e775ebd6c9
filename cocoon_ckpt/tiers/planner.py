"""Profile the tiers and plan the split: integer allocation units per tier that
minimise the slowest tier's GEMV time under every tier's capacity (Cocoon §4.1).

The parameter dimension is cut into allocation units of whole 65,536-coordinate noise
blocks (so every tier's shard is whole blocks of keyed fresh noise, I1). The profile is
one unit's measured GEMV seconds on each tier; a tier holding n units takes n times
that. The plan is exact for that model: the smallest T such that the tiers, each
taking at most min(capacity, floor(T / seconds)) units, cover all units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.tiers.base import Tier, TierCapacityError, TierKind

__all__ = ["Plan", "capacity_units", "plan_units", "profile_tiers"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A split of the history over tiers, in placement order (device, host, far)."""

    unit: int
    """Coordinates per allocation unit (a multiple of the 65,536-coordinate block)."""
    units: int
    """Units covering the dimension (the last may be partial)."""
    counts: dict[str, int]
    """Units per tier name, in placement order."""
    seconds_per_unit: dict[str, float] = field(default_factory=dict)
    """The profile: one unit's GEMV seconds per tier (empty for a fixed split)."""
    capacity_units: dict[str, int] = field(default_factory=dict)
    """The most units each tier could take."""

    @property
    def predicted_s(self) -> float | None:
        """The slowest tier's modelled GEMV seconds (None without a profile)."""
        if not self.seconds_per_unit:
            return None
        return max(
            (n * self.seconds_per_unit.get(t, 0.0) for t, n in self.counts.items()), default=0.0
        )

    def ranges(self, dim: int) -> list[tuple[str, int, int]]:
        """(tier, start, stop) column ranges, contiguous in placement order."""
        out, lo = [], 0
        for tier, n in self.counts.items():
            hi = min(dim, lo + n * self.unit)
            out.append((tier, lo, hi))
            lo = hi
        return out

    def to_record(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "units": self.units,
            "counts": dict(self.counts),
            "seconds_per_unit": dict(self.seconds_per_unit),
            "capacity_units": dict(self.capacity_units),
            "predicted_s": self.predicted_s,
        }


def capacity_units(
    kind: TierKind, capacity: int, *, slots: int, unit: int, itemsize: int, units: int
) -> int:
    """The most units a tier of `capacity` bytes can hold.

    The device also holds the merge buffer, the whole (dim,) result that the other
    tiers' partial results land in, so its history gets what is left after that.

    Raises:
        TierCapacityError: the device cannot even hold the merge buffer.
    """
    per_unit = max(slots, 1) * unit * itemsize
    if kind is TierKind.DEVICE:
        merge = units * unit * itemsize
        if capacity < merge:
            raise TierCapacityError(
                f"device tier capacity {capacity} bytes cannot hold the merge buffer of "
                f"{merge} bytes ({merge - capacity} missing); give the device more memory or "
                "no device tier"
            )
        capacity -= merge
    return min(units, capacity // per_unit)


def plan_units(
    units: int, seconds_per_unit: Mapping[str, float], capacity: Mapping[str, int]
) -> dict[str, int]:
    """Integer units per tier minimising max_i n_i * seconds_i, with n_i <= capacity_i
    and sum n_i = units. Ties go to the earlier tiers in `capacity`'s order.

    Raises:
        TierCapacityError: the capacities together hold fewer than `units`.
    """
    names = list(capacity)
    total = sum(capacity[n] for n in names)
    if total < units:
        raise TierCapacityError(
            f"the tiers hold {total} of the {units} allocation units the history needs "
            f"({units - total} missing)"
        )
    if units == 0:
        return dict.fromkeys(names, 0)
    for n in names:
        if capacity[n] > 0 and not seconds_per_unit.get(n, 0.0) > 0:
            raise ValueError(f"tier {n}: profiled seconds per unit must be > 0")

    def take(n: str, limit: float) -> int:
        s = seconds_per_unit[n]
        return min(capacity[n], int(math.floor(limit / s * (1 + 1e-12))))

    candidates = sorted({k * seconds_per_unit[n] for n in names for k in range(1, capacity[n] + 1)})
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # the smallest feasible bound: feasibility is monotone in T
        mid = (lo + hi) // 2
        if sum(take(n, candidates[mid]) for n in names if capacity[n]) >= units:
            hi = mid
        else:
            lo = mid + 1
    bound = candidates[lo]
    counts = {n: take(n, bound) if capacity[n] else 0 for n in names}
    surplus = sum(counts.values()) - units
    # Give back the surplus from the slowest tiers first: the bound stays met.
    for n in sorted(names, key=lambda n: -seconds_per_unit.get(n, 0.0)):
        give = min(surplus, counts[n])
        counts[n] -= give
        surplus -= give
    return counts


def profile_tiers(
    tiers: Sequence[Tier],
    *,
    slots: int,
    unit: int,
    dtype: np.dtype[Any] | str,
    probe_units: int = 2,
    reps: int = 3,
) -> dict[str, float]:
    """One unit's GEMV seconds on each tier: the median over `reps` of a scratch shard
    of `probe_units` units, divided by `probe_units` (amortising per-call overhead)."""
    if unit % BLOCK:
        raise ValueError(f"unit={unit} must be a multiple of the {BLOCK}-coordinate block")
    out = {}
    for t in tiers:
        seconds = t.profile(slots, unit * probe_units, dtype, reps)
        out[t.name] = max(seconds / probe_units, 1e-9)
    return out
