"""The fastest dense GEMV available, as rings bench/dlrm.py's dense baselines hold.

The engine's GEMV has one fixed order of rounding, so that a tiered, sharded or resumed
history adds bit-identical noise (`cocoon_ckpt.dp.gemv`). BLAS gives up that guarantee
(its order depends on the thread count, the kernel and where a column range starts),
which is why the engine does not use it; as a speed baseline it is the honest one: a
dense DP job that did not care about bit-exact resumes would run it. These rings are
`RingHistory`s for the benchmark only, swapped into a dense trainer before its first
step (`use_ring`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cocoon_ckpt import DPTrainer
from cocoon_ckpt.dp.ring import HostRing, RingHistory

__all__ = ["BlasRing", "TorchMvRing", "use_ring"]


class BlasRing(HostRing):
    """A host ring whose GEMV is numpy's `mix @ ring`: BLAS (OpenBLAS here) gemv on all
    cores, in whatever order of rounding it picks."""

    def gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        ring = self._array()
        h: np.ndarray = np.matmul(np.asarray(mix, dtype=ring.dtype), ring, out=out)
        return h


class TorchMvRing:
    """The ring as one torch tensor on `device` (CUDA where there is one, else the CPU),
    its GEMV `torch.mv` (cuBLAS / MKL); w_t goes to the device and h_t comes back each
    step, as the engine's device tier does.

    Args:
        slots: b - 1 ring slots.
        width: columns in all.
        dtype: float32 or float64.
        device: where the ring lives.
    """

    plan: dict[str, Any] | None = None

    def __init__(
        self, slots: int, width: int, dtype: np.dtype[Any] | str, device: torch.device
    ) -> None:
        self.slots, self.width, self.dtype = slots, width, np.dtype(dtype)
        tdt = torch.float64 if self.dtype == np.float64 else torch.float32
        self.device = device
        self._ring: torch.Tensor | None = torch.zeros(slots, width, dtype=tdt, device=device)

    def _tensor(self) -> torch.Tensor:
        if self._ring is None:
            raise ValueError("TorchMvRing is closed: build a new ring to hold noise again")
        return self._ring

    @property
    def nbytes(self) -> int:
        return self.slots * self.width * self.dtype.itemsize

    def placement(self) -> list[dict[str, Any]]:
        return [{"tier": self.device.type, "start": 0, "stop": self.width}]

    def write(self, slot: int, w: np.ndarray) -> None:
        self._tensor()[slot].copy_(torch.from_numpy(np.asarray(w, dtype=self.dtype)))

    def read(self, slot: int, out: np.ndarray | None = None) -> np.ndarray:
        row: np.ndarray = self._tensor()[slot].cpu().numpy()
        if out is None:
            return row.copy()
        out[...] = row
        return out

    def gather(self) -> np.ndarray:
        out: np.ndarray = self._tensor().cpu().numpy().copy()
        return out

    def scatter(self, ring: np.ndarray) -> None:
        self._tensor().copy_(torch.from_numpy(np.asarray(ring, dtype=self.dtype)))

    def gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        ring = self._tensor()
        m = torch.from_numpy(np.asarray(mix, dtype=self.dtype)).to(self.device)
        h: np.ndarray = torch.mv(ring.t(), m).cpu().numpy()
        if out is None:
            return h
        out[...] = h
        return out

    def close(self) -> None:
        self._ring = None


def use_ring(tr: DPTrainer, make: Callable[[int, int, np.dtype[Any]], RingHistory]) -> None:
    """Give every dense table of `tr` a ring built by `make(slots, width, dtype)` in
    place of its fixed-order history; call before the first step (both hold zeros).

    Raises:
        ValueError: the trainer has no embedding tables, or has stepped already.
    """
    if tr.embedding is None:
        raise ValueError("use_ring: the trainer has no embedding tables; build it with some")
    for e in tr.embedding.engines:
        if e.online is None:
            continue
        if e.online.t:
            raise ValueError(f"use_ring: table {e.spec.param} is at step {e.online.t}, not 0")
        old = e.online.history
        e.online.history = make(old.slots, old.width, old.dtype)
        old.close()
