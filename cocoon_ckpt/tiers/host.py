"""The host tier: a numpy shard in DRAM, GEMV in a host thread."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from cocoon_ckpt.dp.gemv import mix_history
from cocoon_ckpt.tiers.base import Tier, TierKind

__all__ = ["HostTier"]


class HostTier(Tier):
    """History columns in host memory (numpy), computed by a host thread."""

    kind = TierKind.HOST

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ring = np.zeros((0, 0), dtype=np.float32)

    def _allocate(self) -> None:
        # Every page touched now, when the job starts: np.zeros' lazy zero pages were
        # faulted in by the training steps instead (each of the first b-1 steps its new
        # slot, the first GEMV the rest), ~1 s of an 8M-parameter job's first steps.
        self.ring = np.empty((self.slots, self.width), dtype=self.dtype)
        self.ring.fill(0)

    def _write_slot(self, slot: int, values: np.ndarray) -> None:
        self.ring[slot] = values

    def _read_slot(self, slot: int) -> np.ndarray:
        out: np.ndarray = self.ring[slot].copy()
        return out

    def read_slot_into(self, slot: int, out: np.ndarray) -> None:
        # one copy, no temporary: a checkpoint's fresh pages cost more than the copy
        # (a snapshot's rows took 0.1-4.6 s for 450 MB, by how new its memory was)
        self._check_slot(slot)
        out[...] = self.ring[slot]

    def _pull(self, lo: int, hi: int) -> np.ndarray:
        return self.ring[:, lo:hi].copy()

    def _gemv(self, mix: np.ndarray) -> np.ndarray:
        return mix_history(mix, self.ring)

    def _gemv_into(self, mix: np.ndarray, out: np.ndarray) -> np.ndarray:
        return mix_history(mix, self.ring, out)

    def _profile(self, slots: int, width: int, dtype: np.dtype[Any], reps: int) -> list[float]:
        scratch = np.random.default_rng(0).standard_normal((slots, width)).astype(dtype)
        mix = np.ones(slots, dtype=dtype)
        out = np.empty(width, dtype=dtype)
        mix_history(mix, scratch, out)  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mix_history(mix, scratch, out)
            times.append(time.perf_counter() - t0)
        return times

    def _close(self) -> None:
        self.ring = np.zeros((0, 0), dtype=self.dtype)
