"""The device tier: torch tensors on the compute device, GEMV on a side stream.

On a machine with CUDA the shard lives in GPU memory and the GEMV runs on its own
CUDA stream; without one the same code runs on a CPU torch device, so the path is
exercised (and measured as what it is: emulated) everywhere.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from cocoon_ckpt.dp.gemv import mix_history_torch
from cocoon_ckpt.tiers.base import Tier, TierKind

__all__ = ["DeviceTier", "default_device"]

_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def default_device() -> torch.device:
    """CUDA when present, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class DeviceTier(Tier):
    """History columns as a torch tensor on `device`.

    Args:
        capacity: bytes for the shard and the merge buffer (the planner counts both).
        device: torch device (default: CUDA when present, else CPU).
    """

    kind = TierKind.DEVICE

    def __init__(self, capacity: int, device: torch.device | str | None = None) -> None:
        super().__init__(capacity)
        self.device = torch.device(device) if device is not None else default_device()
        self.ring = torch.zeros(0, 0)
        self._stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]

    @property
    def emulated(self) -> bool:
        """True when the device is the CPU (no accelerator here)."""
        return self.device.type != "cuda"

    def _allocate(self) -> None:
        self.ring = torch.zeros(
            self.slots, self.width, dtype=_TORCH[self.dtype], device=self.device
        )

    def _write_slot(self, slot: int, values: np.ndarray) -> None:
        self.ring[slot].copy_(torch.from_numpy(values))

    def _read_slot(self, slot: int) -> np.ndarray:
        return self.ring[slot].cpu().numpy().copy()

    def _pull(self, lo: int, hi: int) -> np.ndarray:
        return self.ring[:, lo:hi].cpu().numpy().copy()

    def _run(self, mix: np.ndarray, ring: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            return mix_history_torch(mix, ring)
        with torch.cuda.stream(self._stream):
            out = mix_history_torch(mix, ring)
        self._stream.synchronize()
        return out

    def _gemv(self, mix: np.ndarray) -> np.ndarray:
        return self._run(mix, self.ring).cpu().numpy()

    def gemv_pulled(self, mix: np.ndarray, shard: np.ndarray) -> np.ndarray:
        """The GEMV of a shard pulled here from another tier (the GPU-GEMV baseline):
        copy it to the device, compute, return the (width,) result."""
        ring = torch.from_numpy(np.ascontiguousarray(shard)).to(self.device)
        return self._run(mix, ring).cpu().numpy()

    def _profile(self, slots: int, width: int, dtype: np.dtype[Any], reps: int) -> list[float]:
        scratch = torch.randn(slots, width, dtype=_TORCH[dtype], device=self.device)
        mix = np.ones(slots, dtype=dtype)
        self._run(mix, scratch)  # warm
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self._run(mix, scratch)
            times.append(time.perf_counter() - t0)
        return times

    def _close(self) -> None:
        self.ring = torch.zeros(0, 0)
