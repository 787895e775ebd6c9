"""Precompute a table's coalesced noise, tile by tile over rows, before step 0.

For a tile of cold rows the BandMF recursion runs over all steps with the same keyed
fresh noise the online mechanism would draw (I1), the tile's (b-1) x width history
staying in fast memory. What a row receives between two reads is summed, scaled by
-lr_s / B per step, into one entry applied just before the next read; what follows its
last read is its tail (column n). Each coordinate's arithmetic is elementwise and in a
fixed order, so the entries are bit-identical for any tiling and any order of tiles.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
import torch

from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise, bandmf_step
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.schedule import AccessSchedule

__all__ = ["default_tile_rows", "precompute_csc", "table_key", "table_noise"]

#: A precompute tile's history aims at this many bytes (fits a large L2 / L3 slice).
TILE_HISTORY_BYTES = 8 << 20


def table_key(key: bytes, param: str) -> bytes:
    """A table's 32-byte noise key, derived from the job's key and the parameter name
    (keyed BLAKE2b); as secret as the job's key."""
    return hashlib.blake2b(param.encode(), key=key, digest_size=32, person=b"cocoon-emb").digest()


def table_noise(
    key: bytes,
    param: str,
    rows: int,
    dim: int,
    std: float,
    dtype: str | torch.dtype,
    rng: NoiseRng | str = NoiseRng.DEFAULT,
) -> KeyedNoise:
    """The keyed fresh noise of one table's noise space, R * dim coordinates, drawn by
    the generator `rng`: each table has its own coordinate space, and slot p (rows in
    `AccessSchedule.noise_order`) holds coordinates [p * dim, (p + 1) * dim)."""
    return KeyedNoise(table_key(key, param), rows * dim, std, dtype, rng)


def default_tile_rows(dim: int, bands: int, itemsize: int) -> int:
    """Rows per tile: whole fresh-noise blocks, history near TILE_HISTORY_BYTES."""
    width = TILE_HISTORY_BYTES // (max(bands - 1, 1) * itemsize)
    width = max(BLOCK, width // BLOCK * BLOCK)
    return max(1, width // dim)


def _tiles(first: int, rows: int, tile_rows: int) -> list[np.ndarray]:
    # Absolute tile boundaries (multiples of tile_rows) keep whole noise blocks together.
    edges = list(range((first // tile_rows + 1) * tile_rows, rows, tile_rows))
    bounds = [first, *edges, rows]
    return [
        np.arange(a, z, dtype=np.int64)
        for a, z in zip(bounds[:-1], bounds[1:], strict=False)
        if z > a
    ]


def precompute_csc(
    schedule: AccessSchedule,
    order: np.ndarray,
    hot: int,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
    *,
    tile_rows: int | None = None,
    tiles: Sequence[np.ndarray] | None = None,
    progress: Callable[[int], None] | None = None,
) -> CoalescedCSC:
    """The coalesced entries of every cold row of one table.

    Args:
        schedule: the table's reads.
        order: (R,) `schedule.noise_order()`: slot p belongs to row order[p].
        hot: H; slots [0, H) are hot (online) and get no entries.
        dim: the embedding width.
        mechanism: the BandMF strategy.
        noise: `table_noise(...)` of this table.
        factors: (n,) float64, lr_s / B of every step s.
        tile_rows: slots per tile (default: `default_tile_rows`).
        tiles: explicit tiles (arrays of slots >= hot, each slot once), any order.
        progress: called with the slots finished after each tile.

    Returns:
        The CSC, columns 0..n-1 and the tails in column n.
    """
    n = schedule.steps
    if factors.shape[0] < n:
        raise ValueError(f"factors has {factors.shape[0]} steps, the precompute needs {n}")
    rows = schedule.rows
    if tiles is None:
        itemsize = torch.empty(0, dtype=noise.dtype).element_size()
        tr = tile_rows or default_tile_rows(dim, mechanism.bands, itemsize)
        tiles = _tiles(hot, rows, tr)
    np_dtype = noise.np_dtype
    slots_ = mechanism.bands - 1
    # every tile runs the same n steps: their mixing vectors are built once
    mixes = [mechanism.mixing_vector(t).astype(np_dtype) for t in range(n)] if slots_ else []
    cols: list[np.ndarray] = []
    rows_out: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for tile in tiles:
        tile = np.asarray(tile, dtype=np.int64)
        if tile.size == 0:
            continue
        if tile.min() < hot:
            raise ValueError(f"a tile holds hot slot {int(tile.min())} (< hot={hot})")
        k = tile.size
        trows = order[tile]
        lo, hi = int(tile.min()) * dim, (int(tile.max()) + 1) * dim
        contiguous = hi - lo == k * dim and bool(np.all(np.diff(tile) == 1))
        coords = None if contiguous else (tile[:, None] * dim + np.arange(dim) - lo).ravel()
        # this tile's reads, by step: (step, local row)
        starts, stops = schedule.row_ptr[trows], schedule.row_ptr[trows + 1]
        lens = stops - starts
        local = np.repeat(np.arange(k, dtype=np.int64), lens)
        # positions in row_steps of every read of these rows, without a loop per row
        idx = np.arange(local.size) + np.repeat(starts - (np.cumsum(lens) - lens), lens)
        ev_step = schedule.row_steps[idx]
        by_step = np.argsort(ev_step, kind="stable")
        ev_step, local = ev_step[by_step], local[by_step]
        bounds = np.searchsorted(ev_step, np.arange(n + 1))
        hist = HostRing(slots_, k * dim, np_dtype)
        acc = np.zeros((k, dim), dtype=np.float64)
        for t in range(n):
            z = noise.fresh(t, lo, hi)
            if coords is not None:
                z = z[torch.from_numpy(coords)]
            w = bandmf_step(mechanism, t, z, hist, mix=mixes[t] if slots_ else None)
            a, b = bounds[t], bounds[t + 1]
            if b > a:
                sel = local[a:b]
                cols.append(np.full(b - a, t, dtype=np.int64))
                rows_out.append(trows[sel])
                vals.append((-acc[sel]).astype(np_dtype))
                acc[sel] = 0.0
            acc += float(factors[t]) * w.numpy().reshape(k, dim).astype(np.float64)
        cols.append(np.full(k, n, dtype=np.int64))
        rows_out.append(trows)
        vals.append((-acc).astype(np_dtype))
        if progress is not None:
            progress(k)
    if not cols:
        return CoalescedCSC(
            np.zeros(n + 2, np.int64), np.zeros(0, np.int64), np.zeros((0, dim), np_dtype)
        )
    return CoalescedCSC.from_entries(
        n, np.concatenate(cols), np.concatenate(rows_out), np.concatenate(vals)
    )
