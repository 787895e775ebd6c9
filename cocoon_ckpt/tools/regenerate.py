"""The correlated noise w_t at a few coordinates, regenerated from the key the engine's way.

What audit compares stored ring slots with: the recursion is coordinate-wise, so a few
coordinates need only their own history, and the fixed-order GEMV makes any subset of
coordinates reproduce the stored values bit for bit (I1, I2).
"""

from __future__ import annotations

import numpy as np
import torch

from cocoon_ckpt.dp.gemv import mix_history
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise

__all__ = ["regenerate"]


def regenerate(
    key: bytes,
    mechanism: BandMF,
    dim: int,
    std: float,
    dtype: str,
    coords: np.ndarray,
    steps: int,
) -> np.ndarray:
    """w_t at `coords` for t < steps, (steps, len(coords)), computed the engine's way:
    the recursion is coordinate-wise, so a few coordinates need only their own history
    (their fresh noise blocks are drawn whole, as I1 defines them)."""
    fresh = KeyedNoise(key, dim, std, dtype)
    tdtype = fresh.dtype
    slots = mechanism.bands - 1
    c0 = float(mechanism.coefficients[0])
    blocks = np.unique(coords // BLOCK)
    out = torch.empty(steps, len(coords), dtype=tdtype)
    ring = torch.zeros(max(slots, 0), len(coords), dtype=tdtype)
    for t in range(steps):
        z = torch.empty(len(coords), dtype=tdtype)
        for k in blocks:
            lo, hi = int(k) * BLOCK, min((int(k) + 1) * BLOCK, dim)
            sel = np.nonzero(coords // BLOCK == k)[0]
            zb = fresh.fresh(t, lo, hi)
            z[sel] = zb[torch.from_numpy(coords[sel] - lo)]
        if slots:
            # the engine's kernel: one order of rounding, so any subset of coordinates
            # reproduces the stored values bit for bit
            w = (z - torch.from_numpy(mix_history(mechanism.mixing_vector(t), ring.numpy()))) / c0
            ring[t % slots].copy_(w)
        else:
            w = z / c0
        out[t] = w
    return out.numpy()
