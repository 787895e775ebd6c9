"""Tiers: the noise history split across device, host and far memory, each part
computed where it lies, planned from a profile (Cocoon §4.1, §4.3).

Names load on first use (PEP 562): the far-memory worker process imports
`cocoon_ckpt.tiers._far_worker` and must not pull torch in with this package.
"""

from typing import TYPE_CHECKING

from cocoon_ckpt._lazy import attach

if TYPE_CHECKING:
    from cocoon_ckpt.tiers.base import GemvMode, Tier, TierCapacityError, TierError, TierKind
    from cocoon_ckpt.tiers.build import build_history, free_host_bytes
    from cocoon_ckpt.tiers.config import TierConfig
    from cocoon_ckpt.tiers.device import DeviceTier, default_device
    from cocoon_ckpt.tiers.far import FarTier
    from cocoon_ckpt.tiers.history import TieredHistory
    from cocoon_ckpt.tiers.host import HostTier
    from cocoon_ckpt.tiers.planner import Plan, capacity_units, plan_units, profile_tiers

_LAZY = {
    "DeviceTier": "device",
    "FarTier": "far",
    "GemvMode": "base",
    "HostTier": "host",
    "Plan": "planner",
    "Tier": "base",
    "TierCapacityError": "base",
    "TierConfig": "config",
    "TierError": "base",
    "TierKind": "base",
    "TieredHistory": "history",
    "build_history": "build",
    "capacity_units": "planner",
    "default_device": "device",
    "free_host_bytes": "build",
    "plan_units": "planner",
    "profile_tiers": "planner",
}


__getattr__, __dir__ = attach(__name__, _LAZY)


__all__ = [
    "DeviceTier",
    "FarTier",
    "GemvMode",
    "HostTier",
    "Plan",
    "Tier",
    "TierCapacityError",
    "TierConfig",
    "TierError",
    "TierKind",
    "TieredHistory",
    "build_history",
    "capacity_units",
    "default_device",
    "free_host_bytes",
    "plan_units",
    "profile_tiers",
]
