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
    after: Iterable[int],
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> dict[int, np.ndarray]:
    """The mechanism's stored rows at `coords` after each step t in `after`,
    {t: (rows, len(coords))}, from the key and the generator `rng` the job drew its
    noise with: row t mod (b-1) of entry t is BandMF's ring slot of step t (w_t as the
    ring keeps it, before a column-normalized C's scale), row i a BLT's buffer i."""
    noise = noise_for(mechanism, dim, key, std, dtype, start=0, stop=0, rng=rng)
    try:
        return noise.regenerate_rows(coords, after)
    finally:
        noise.close()
