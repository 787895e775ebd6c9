"""Noise for sparse embedding tables (Cocoon §4.2): the access schedule known from the
seeded sampler, coalesced noise precomputed tile by tile into CSC, a hot/cold split
chosen from a profile, lazy DP-SGD noise at b = 1, and per-sample row gradients.

Coalescing holds only against an adversary who sees the final model
(threat_model="final_model"); it is exact for plain SGD (I5).
"""

from typing import TYPE_CHECKING

from cocoon_ckpt._lazy import attach

if TYPE_CHECKING:
    from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode, TableSpec
    from cocoon_ckpt.embedding.csc import CoalescedCSC
    from cocoon_ckpt.embedding.engine import TableEngine, TablePlan
    from cocoon_ckpt.embedding.lazy import LazyNoise, philox_normal
    from cocoon_ckpt.embedding.precompute import precompute_csc, table_key, table_noise
    from cocoon_ckpt.embedding.profile import UnitCosts, choose_threshold, measure_unit_costs
    from cocoon_ckpt.embedding.schedule import AccessSchedule, table_schedule
    from cocoon_ckpt.embedding.tables import EmbeddingNoise

_LAZY = {
    "AccessSchedule": "schedule",
    "CoalescedCSC": "csc",
    "EmbeddingConfig": "config",
    "EmbeddingNoise": "tables",
    "LazyNoise": "lazy",
    "TableEngine": "engine",
    "TableMode": "config",
    "TablePlan": "engine",
    "TableSpec": "config",
    "UnitCosts": "profile",
    "choose_threshold": "profile",
    "measure_unit_costs": "profile",
    "philox_normal": "lazy",
    "precompute_csc": "precompute",
    "table_key": "precompute",
    "table_noise": "precompute",
    "table_schedule": "schedule",
}

__getattr__, __dir__ = attach(__name__, _LAZY)

__all__ = [
    "AccessSchedule",
    "CoalescedCSC",
    "EmbeddingConfig",
    "EmbeddingNoise",
    "LazyNoise",
    "TableEngine",
    "TableMode",
    "TablePlan",
    "TableSpec",
    "UnitCosts",
    "choose_threshold",
    "measure_unit_costs",
    "philox_normal",
    "precompute_csc",
    "table_key",
    "table_noise",
    "table_schedule",
]
