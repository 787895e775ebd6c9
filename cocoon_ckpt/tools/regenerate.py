"""The correlated noise at a few coordinates, regenerated from the key the engine's way:
BandMF's w_t, or a BLT's buffers.

What audit compares stored ring slots (and BLT buffers) with: the recursion is
coordinate-wise, so a few coordinates need only their own history, and the fixed-order
GEMV makes any subset of coordinates reproduce the stored values bit for bit (I1, I2).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from cocoon_ckpt.dp.blt.strategy import BLT, blt_step
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise, bandmf_step
from cocoon_ckpt.dp.ring import HostRing

__all__ = ["regenerate", "regenerate_blt_buffers"]


def _fresh_at(fresh: KeyedNoise, t: int, coords: np.ndarray, dim: int) -> torch.Tensor:
    """z_t at `coords`: their fresh noise blocks drawn whole, as I1 defines them."""
    z = torch.empty(len(coords), dtype=fresh.dtype)
    for k in np.unique(coords // BLOCK):
        lo, hi = int(k) * BLOCK, min((int(k) + 1) * BLOCK, dim)
        sel = np.nonzero(coords // BLOCK == k)[0]
        zb = fresh.fresh(t, lo, hi)
        z[sel] = zb[torch.from_numpy(coords[sel] - lo)]
    return z


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
    out = torch.empty(steps, len(coords), dtype=fresh.dtype)
    # the engine's step and kernel: one order of rounding, so any subset of coordinates
    # reproduces the stored values bit for bit
    ring = HostRing(mechanism.bands - 1, len(coords), fresh.np_dtype)
    for t in range(steps):
        out[t] = bandmf_step(mechanism, t, _fresh_at(fresh, t, coords, dim), ring)
    return out.numpy()


def regenerate_blt_buffers(
    key: bytes,
    blt: BLT,
    dim: int,
    std: float,
    dtype: str,
    coords: np.ndarray,
    after: Iterable[int],
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> dict[int, np.ndarray]:
    """A BLT's d buffers at `coords` after each step t in `after`, by replaying
    `blt_step` from step 0 (O(t d) per coordinate): {t: (d, len(coords))}, bit for bit
    what the engine held (the same step, kernel and fresh noise as `regenerate`)."""
    want = set(after)
    fresh = KeyedNoise(key, dim, std, dtype, rng)
    bufs = HostRing(blt.buffers, len(coords), fresh.np_dtype)
    out: dict[int, np.ndarray] = {}
    for t in range(max(want, default=-1) + 1):
        blt_step(blt, t, _fresh_at(fresh, t, coords, dim), bufs)
        if t in want:
            out[t] = bufs.gather()
    return out
