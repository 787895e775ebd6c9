"""Lazy DP-SGD noise (b = 1): a row's missed steps drawn as one Gaussian when it is read.

At b = 1 the noise of different steps is independent, so the sum of a row's per-step
updates over its k unread steps, -sum_s lr_s z_s / B, is one Gaussian with variance
sum_s (lr_s / B)^2 std^2 per coordinate (LazyDP). It is drawn from Philox4x32-10, a
counter-based generator, at counter (row, segment, block): a pure function of the key,
the row and which of the row's gaps it is, so a resume redraws the same values. This
equals per-step noise in distribution, not in value. At b > 1 the per-step noise is
correlated and the shortcut is wrong: that is what the precompute is for.

Under torch.distributed (`RowShares`) the draws of each call are split evenly by rank:
a rank draws its contiguous share of the rows, and one all-gather gives every rank all of
them. A row's draw depends on nothing but its counter, so the gathered updates are the
one process's bit for bit, on any world size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["LazyNoise", "RowShares", "philox_normal", "share_counts"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_MASK, _S32 = np.uint64(0xFFFFFFFF), np.uint64(32)


def _philox4x32(
    c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray, k0: int, k1: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 (Salmon et al., SC'11) over uint64 arrays holding 32-bit counter
    words (updated in place: every round is six passes with no temporaries)."""
    key0, key1 = np.uint64(k0), np.uint64(k1)
    p0, p1 = np.empty_like(c0), np.empty_like(c0)
    for _ in range(10):
        np.multiply(c0, _M0, out=p0)
        np.multiply(c2, _M1, out=p1)
        # c0' = hi(M1 c2) ^ c1 ^ k0, c1' = lo(M1 c2), c2' = hi(M0 c0) ^ c3 ^ k1, c3' = lo(M0 c0)
        np.right_shift(p1, _S32, out=c0)
        np.bitwise_xor(c0, c1, out=c0)
        np.bitwise_xor(c0, key0, out=c0)
        np.right_shift(p0, _S32, out=c2)
        np.bitwise_xor(c2, c3, out=c2)
        np.bitwise_xor(c2, key1, out=c2)
        np.bitwise_and(p1, _MASK, out=c1)
        np.bitwise_and(p0, _MASK, out=c3)
        key0, key1 = (key0 + _W0) & _MASK, (key1 + _W1) & _MASK
    return c0, c1, c2, c3


def philox_normal(
    key: tuple[int, int],
    rows: np.ndarray,
    segments: np.ndarray,
    dim: int,
    dtype: type[np.floating] = np.float64,
) -> np.ndarray:
    """(len(rows), dim) standard normals at counters (row, segment, j // 4).

    Box-Muller on pairs of uniforms in (0, 1), four normals per counter; float64 takes
    32-bit uniforms (tails to 6.7 sigma), float32 24-bit ones (5.9 sigma, as a float32
    torch.randn).
    """
    rows = np.asarray(rows, dtype=np.uint64)
    segments = np.asarray(segments, dtype=np.uint64)
    per = -(-dim // 4)
    r = np.repeat(rows, per)
    s = np.repeat(segments, per)
    j = np.tile(np.arange(per, dtype=np.uint64), rows.size)
    words = _philox4x32(r & _MASK, r >> _S32, s & _MASK, (s >> _S32) ^ (j << np.uint64(16)), *key)
    if dtype == np.float32:
        u = [
            ((w >> np.uint64(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-24)
            for w in words
        ]
    else:
        u = [(w.astype(np.float64) + 0.5) * 2.0**-32 for w in words]
    out = np.empty((r.size, 4), dtype=dtype)
    two_pi = dtype(2.0 * np.pi)
    for a in (0, 2):
        rad = np.sqrt(dtype(-2.0) * np.log(u[a]))
        ang = two_pi * u[a + 1]
        np.multiply(rad, np.cos(ang), out=out[:, a])
        np.multiply(rad, np.sin(ang), out=out[:, a + 1])
    return out.reshape(rows.size, per * 4)[:, :dim]


class RowShares(Protocol):
    """The ranks that draw a table's lazy noise together (`train.distributed.DistContext`)."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    def gather_rows(self, part: np.ndarray, counts: Sequence[int]) -> np.ndarray:
        """(sum(counts), dim): every rank's `part` ((counts[rank], dim)), in rank order,
        on every rank. A collective: every rank calls it with the same `counts`."""
        ...


def share_counts(k: int, world: int) -> list[int]:
    """The rows of a k-row draw each rank takes: contiguous, as even as they split
    (np.array_split's sizes)."""
    return [k // world + (1 if r < k % world else 0) for r in range(world)]


class LazyNoise:
    """The lazy b = 1 updates of one table.

    Args:
        key: the table's 32-byte key (`table_noise`'s derivation).
        dim: the embedding width.
        std: sigma * clip (c_0 = 1 at b = 1).
        factors: (n,) float64, lr_s / B of every step.
        dtype: float32 or float64 draws (the table's dtype).
        ranks: the ranks that share the draws (None: this process draws them all).
    """

    def __init__(
        self,
        key: bytes,
        dim: int,
        std: float,
        factors: np.ndarray,
        dtype: type[np.floating] = np.float64,
        ranks: RowShares | None = None,
    ) -> None:
        d = hashlib.blake2b(key, digest_size=8, person=b"cocoon-lazy").digest()
        self._key = (int.from_bytes(d[:4], "little"), int.from_bytes(d[4:], "little"))
        self.dim = dim
        self.std = float(std)
        self.dtype = dtype
        self._f2 = np.concatenate([[0.0], np.cumsum(np.asarray(factors, np.float64) ** 2)])
        self.ranks = ranks

    def __repr__(self) -> str:
        return f"LazyNoise(dim={self.dim}, std={self.std}, key=<secret>)"

    def updates(
        self, rows: np.ndarray, segments: np.ndarray, start: np.ndarray, stop: int | np.ndarray
    ) -> np.ndarray:
        """(k, dim) in `dtype`: each row's update for its gap [start, stop), segment-keyed.

        With `ranks`, a collective: each rank draws its share of the k rows
        (`share_counts`) and every rank returns all k, the same bits as one process.

        Args:
            rows: table rows.
            segments: each row's gap index (0 = before its first read).
            start: each gap's first step.
            stop: each gap's end (the read step, or the horizon for tails).
        """
        var = self._f2[np.asarray(stop)] - self._f2[np.asarray(start)]
        scale = (-self.std * np.sqrt(np.maximum(var, 0.0))).astype(self.dtype)
        rows, segments = np.asarray(rows), np.asarray(segments)
        if self.ranks is None or self.ranks.world == 1:
            out = philox_normal(self._key, rows, segments, self.dim, self.dtype)
            out *= scale[:, None]
            return out
        counts = share_counts(rows.size, self.ranks.world)
        lo = sum(counts[: self.ranks.rank])
        hi = lo + counts[self.ranks.rank]
        part = philox_normal(self._key, rows[lo:hi], segments[lo:hi], self.dim, self.dtype)
        part *= scale[lo:hi, None]
        return self.ranks.gather_rows(part, counts)
