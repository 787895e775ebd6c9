"""The correlated noise w_t at a few coordinates, regenerated from the key the engine's way.

What audit compares stored ring slots with: the recursion is coordinate-wise, so a few
coordinates need only their own history, and the fixed-order GEMV makes any subset of
coordinates reproduce the stored values bit for bit (I1, I2).
"""

from __future__ import annotations

import numpy as np
import torch

from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise, bandmf_step
from cocoon_ckpt.dp.ring import HostRing

__all__ = ["regenerate"]


def regenerate(
    key: bytes,
    mechanism: BandMF,
    dim: int,
    std: float,
    dtype: str,
    coords: np.ndarray,
    steps: int,
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> np.ndarray:
    """w_t at `coords` for t < steps, (steps, len(coords)), computed the engine's way:
    the recursion is coordinate-wise, so a few coordinates need only their own history
    (their fresh noise blocks are drawn whole, as I1 defines them), with the generator
    `rng` the job drew its noise with."""
    fresh = KeyedNoise(key, dim, std, dtype, rng)
    tdtype = fresh.dtype
    blocks = np.unique(coords // BLOCK)
    out = torch.empty(steps, len(coords), dtype=tdtype)
    # the engine's step and kernel: one order of rounding, so any subset of coordinates
    # reproduces the stored values bit for bit
    ring = HostRing(mechanism.bands - 1, len(coords), fresh.np_dtype)
    for t in range(steps):
        z = torch.empty(len(coords), dtype=tdtype)
        for k in blocks:
            lo, hi = int(k) * BLOCK, min((int(k) + 1) * BLOCK, dim)
            sel = np.nonzero(coords // BLOCK == k)[0]
            zb = fresh.fresh(t, lo, hi)
            z[sel] = zb[torch.from_numpy(coords[sel] - lo)]
        out[t] = bandmf_step(mechanism, t, z, ring)
    return out.numpy()
