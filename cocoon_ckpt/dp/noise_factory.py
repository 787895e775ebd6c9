"""The one place that tells BandMF's streaming noise from a BLT's: `noise_for` builds a
strategy's `NoiseMechanism`, `noise_rows` says how many rows of state it keeps.

The trainer (through `cocoon_ckpt.train.mechanisms.build_noise`, which places the rows
over the tiers) and the audit's regeneration (`cocoon_ckpt.tools.regenerate`) both build
their noise here; an import-linter contract keeps the concrete classes out of every
other module above `dp` but the BandMF-only embedding tables.
"""

from __future__ import annotations

import torch

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.blt.noise import BLTNoise
from cocoon_ckpt.dp.blt.strategy import BLT
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise_mechanism import NoiseMechanism
from cocoon_ckpt.dp.ring import RingHistory

__all__ = ["noise_for", "noise_rows"]


def noise_rows(mechanism: BandMF | BLT) -> int:
    """Rows of noise state the mechanism's noise keeps: b - 1 ring slots, or d BLT
    buffers."""
    return mechanism.buffers if isinstance(mechanism, BLT) else mechanism.bands - 1


def noise_for(
    mechanism: BandMF | BLT,
    dim: int,
    key: bytes,
    noise_std: float,
    dtype: str | torch.dtype = "float32",
    *,
    start: int = 0,
    stop: int | None = None,
    rows: RingHistory | None = None,
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> NoiseMechanism:
    """The streaming noise of `mechanism` for the shard [start, stop) of `dim`.

    Args:
        mechanism: a BandMF or a BLT strategy.
        dim: m, the whole dimension (the key's coordinate space).
        key: 32 secret bytes.
        noise_std: sigma * clip.
        dtype: float32 or float64.
        start, stop: the shard; the whole dimension by default.
        rows: where its `noise_rows(mechanism)` rows live (any `RingHistory` of the
            shard's width); a `HostRing` by default.
        rng: the fresh noise's generator.
    """
    if isinstance(mechanism, BLT):
        return BLTNoise(
            mechanism, dim, key, noise_std, dtype, start=start, stop=stop, buffers=rows, rng=rng
        )
    return BandMFNoise(
        mechanism, dim, key, noise_std, dtype, start=start, stop=stop, history=rows, rng=rng
    )
