"""The noise state at a few coordinates, regenerated from the key the engine's way:
what the audit compares stored rows (BandMF's ring slots, a BLT's buffers) with.

The recursion is coordinate-wise, so a few coordinates need only their own history,
and the fixed-order GEMV makes any subset of coordinates reproduce the stored values
bit for bit (I1, I2). The mechanism's own `NoiseMechanism.regenerate_rows` replays it;
this module builds that noise through the one factory (`dp.noise_factory`), for a shard
of no coordinates (nothing of the model's size is allocated).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise_factory import noise_for

__all__ = ["regenerate_rows"]


def regenerate_rows(
    key: bytes,
    mechanism: BandMF | BLT,
    dim: int,
    std: float,
    dtype: str,
    coords: np.ndarray,
    rows: Iterable[tuple[int, int]],
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> dict[tuple[int, int], np.ndarray]:
    """The stored rows `rows`, (slot, step label) each, at `coords`,
    {(slot, label): (len(coords),)}, from the key and the generator `rng` the job drew
    its noise with: BandMF's (t mod (b-1), t) is w_t as its ring keeps it (before a
    column-normalized C's scale), a BLT's (i, t) its buffer i after step t."""
    noise = noise_for(mechanism, dim, key, std, dtype, start=0, stop=0, rng=rng)
    try:
        return noise.regenerate_rows(coords, rows)
    finally:
        noise.close()
