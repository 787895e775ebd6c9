"""Build a job's tiered history from its TierConfig: tiers, capacities, profile, plan."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import numpy as np

from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.base import GemvMode, Tier, TierCapacityError, TierKind
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.tiers.device import DeviceTier, default_device
from cocoon_ckpt.tiers.far import FarTier
from cocoon_ckpt.tiers.history import TieredHistory
from cocoon_ckpt.tiers.host import HostTier
from cocoon_ckpt.tiers.planner import Plan, capacity_units, plan_units, profile_tiers
from state.process import available_memory

__all__ = ["build_history", "free_host_bytes"]

log = logging.getLogger(__name__)


def free_host_bytes() -> int:
    """Host memory available now (MemAvailable; where the kernel does not say, the free
    physical pages), bytes."""
    return available_memory() or int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _device_bytes(cfg: TierConfig) -> int:
    if cfg.device_bytes is not None:
        return cfg.device_bytes
    import torch

    dev = default_device() if cfg.device is None else torch.device(cfg.device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free // 2)
    return free_host_bytes() // 8


def _make_tiers(cfg: TierConfig) -> list[Tier]:
    tiers: list[Tier] = []
    dev = _device_bytes(cfg)
    if dev or cfg.mode is GemvMode.PULL_TO_DEVICE:
        tiers.append(DeviceTier(dev, device=cfg.device))
    host = free_host_bytes() // 2 if cfg.host_bytes is None else cfg.host_bytes
    if host:
        tiers.append(HostTier(host))
    if cfg.far_bytes != 0:
        folder = cfg.far_dir or tempfile.gettempdir()
        far = int(shutil.disk_usage(folder).free * 0.9) if cfg.far_bytes is None else cfg.far_bytes
        tiers.append(FarTier(far, folder=cfg.far_dir, link_bytes_per_s=cfg.far_link_bytes_per_s))
    if not tiers:
        raise TierCapacityError("TierConfig gives no tier any memory; give host_bytes > 0")
    return tiers


def build_history(
    slots: int, width: int, dtype: np.dtype[Any] | str, cfg: TierConfig | None
) -> TieredHistory:
    """The (slots, width) history over the tiers `cfg` allows, split by the plan.

    Without a config: one host tier, no profiling. With one: capacities from the config
    or from what is free, a profile of one unit on each tier and the min-max plan, or
    the fixed `counts`.

    Raises:
        TierCapacityError: the tiers cannot hold the history (how much is missing).
    """
    dt = np.dtype(dtype)
    if cfg is None:
        return TieredHistory.single_host(slots, width, dt)
    unit = cfg.unit_blocks * BLOCK
    units = -(-width // unit)
    tiers = _make_tiers(cfg)
    try:
        caps: dict[str, int] = {}
        for t in tiers:
            caps[t.name] = capacity_units(
                t.kind, t.capacity, slots=slots, unit=unit, itemsize=dt.itemsize, units=units
            )
        if sum(caps.values()) < units:
            per_unit = max(slots, 1) * unit * dt.itemsize
            have = sum(t.capacity for t in tiers)
            raise TierCapacityError(
                f"the history needs {units} units of {per_unit} bytes ({units * per_unit} "
                f"bytes, plus the device's merge buffer when there is a device tier); the "
                f"tiers have {have} bytes ({', '.join(f'{t.name} {t.capacity}' for t in tiers)})"
                f": {(units - sum(caps.values())) * per_unit} bytes missing. Give a tier more "
                "memory, or add a far tier on a local disk (TierConfig far_bytes=None, far_dir"
                '=a folder; --tiers \'{"far_bytes": null, "far_dir": "/var/tmp"}\')'
            )
        seconds: dict[str, float] = {}
        if cfg.counts is not None:
            counts = {t.name: cfg.counts.get(t.name, 0) for t in tiers}
            extra = set(cfg.counts) - set(counts)
            if extra or sum(counts.values()) != units:
                raise ConfigError(
                    f"TierConfig.counts={cfg.counts}: must split {units} units over the "
                    f"tiers {list(counts)}"
                )
            for name, n in counts.items():
                if n > caps[name]:
                    raise TierCapacityError(
                        f"TierConfig.counts gives the {name} tier {n} units, it holds {caps[name]}"
                    )
        elif len(tiers) == 1:
            counts = {tiers[0].name: units}
        else:
            live = [t for t in tiers if caps[t.name] > 0]
            seconds = profile_tiers(
                live,
                slots=max(slots, 1),
                unit=unit,
                dtype=dt,
                probe_units=max(1, min(units, 2)),
                reps=cfg.profile_reps,
            )
            counts = plan_units(units, seconds, caps)
        plan = Plan(
            unit=unit, units=units, counts=counts, seconds_per_unit=seconds, capacity_units=caps
        )
        record = {**plan.to_record(), "mode": cfg.mode.value}
        device = next((t for t in tiers if t.kind is TierKind.DEVICE), None)
        if device is not None:
            record["device_emulated"] = bool(getattr(device, "emulated", True))
        log.info("tier plan: %s", record)
        return TieredHistory(slots, width, dt, tiers, counts, unit, mode=cfg.mode, plan=record)
    except BaseException:
        for t in tiers:
            t.close()
        raise
