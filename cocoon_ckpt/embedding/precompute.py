"""Precompute a table's coalesced noise, tile by tile over rows, before step 0.

For a tile of cold rows the BandMF recursion runs over all steps with the same keyed
fresh noise the online mechanism would draw (I1), the tile's (b-1) x width history
staying in fast memory. What a row receives between two reads is summed, scaled by
-lr_s / B per step, into one entry applied just before the next read; what follows its
last read is its tail (column n). Each coordinate's arithmetic is elementwise and in a
fixed order, so the entries are bit-identical for any tiling and any order of tiles.

Tiles are independent, so several run at once, one thread each (numpy, torch and the
compiled kernels release the GIL while they work on arrays), with the same bits. Each
worker runs torch and numba on one thread: one tile at a time on their intra-op threads
leaves the Python-side work serial and waits at their barriers, which stall when other
processes share the cores. Measured on this 2-core machine under other load: 2.3x
(median of 5 interleaved runs, 60,000 rows, b = 8; bench/dlrm.py --serial-precompute).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS
from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise, bandmf_step
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.schedule import AccessSchedule

__all__ = [
    "default_threads",
    "default_tile_rows",
    "precompute_csc",
    "table_key",
    "table_noise",
]

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


def _single_threaded(numba: bool) -> None:
    # A tile worker computes with one thread, so two tiles use two cores and not four
    # threads: torch's and numba's thread counts belong to the calling thread (OpenMP),
    # so the caller's own are untouched. The keyed fresh noise then draws its blocks in
    # this thread too (it asks torch how many threads it has).
    torch.set_num_threads(1)
    if numba:
        import numba as nb

        nb.set_num_threads(1)


def default_threads() -> int:
    """Tiles computed at once by default: the caller's torch thread count (all cores
    unless the process was told otherwise)."""
    return max(1, torch.get_num_threads())


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
    threads: int | None = None,
) -> CoalescedCSC:
    """The coalesced entries of every cold row of one table.

    Tiles are independent (each runs its own rows' recursion over all n steps), so
    `threads` of them run at once; every entry is the same bits for any thread count,
    because an entry's arithmetic never involves another tile and the CSC is sorted by
    (column, row) whatever order the tiles finish in.

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
        progress: called (in the caller's thread) with the slots finished after each tile.
        threads: tiles computed at once, each on one thread (None: `default_threads()`;
            1: in the caller's thread, with the caller's torch and numba threads).

    Returns:
        The CSC, columns 0..n-1 and the tails in column n.

    Raises:
        ValueError: `factors` is shorter than the run, `threads` < 1, or a tile holds a
            hot slot.
    """
    n = schedule.steps
    if factors.shape[0] < n:
        raise ValueError(f"factors has {factors.shape[0]} steps, the precompute needs {n}")
    workers = default_threads() if threads is None else threads
    if workers < 1:
        raise ValueError(f"precompute_csc threads={threads}: give 1 or more (None: all cores)")
    if tiles is None:
        itemsize = torch.empty(0, dtype=noise.dtype).element_size()
        tr = tile_rows or default_tile_rows(dim, mechanism.bands, itemsize)
        tiles = _tiles(hot, schedule.rows, tr)
    todo = [t for t in (np.asarray(t, dtype=np.int64) for t in tiles) if t.size]
    for tile in todo:
        if tile.min() < hot:
            raise ValueError(f"a tile holds hot slot {int(tile.min())} (< hot={hot})")
    np_dtype = noise.np_dtype
    slots_ = mechanism.bands - 1
    # every tile runs the same n steps: their mixing vectors are built once
    mixes = [mechanism.mixing_vector(t).astype(np_dtype) for t in range(n)] if slots_ else []

    def run(tile: np.ndarray) -> _Entries:
        return _tile_entries(tile, schedule, order, dim, mechanism, noise, factors, mixes)

    parts: list[_Entries] = []
    if workers == 1 or len(todo) < 2:
        for tile in todo:
            parts.append(run(tile))
            if progress is not None:
                progress(tile.size)
    else:
        # the compiled GEMV runs once a tile's ring reaches its threshold
        numba = any(t.size * dim * slots_ >= COMPILED_MIN_ELEMENTS for t in todo)
        with ThreadPoolExecutor(
            min(workers, len(todo)),
            thread_name_prefix="cocoon-pre",
            initializer=_single_threaded,
            initargs=(numba,),
        ) as pool:
            # map yields in tile order and re-raises a worker's error here
            for tile, part in zip(todo, pool.map(run, todo), strict=True):
                parts.append(part)
                if progress is not None:
                    progress(tile.size)
    if not parts:
        return CoalescedCSC(
            np.zeros(n + 2, np.int64), np.zeros(0, np.int64), np.zeros((0, dim), np_dtype)
        )
    return CoalescedCSC.from_entries(
        n,
        np.concatenate([c for p in parts for c in p[0]]),
        np.concatenate([r for p in parts for r in p[1]]),
        np.concatenate([v for p in parts for v in p[2]]),
    )


#: One tile's entries: (columns, rows, values) chunks, concatenated by the caller.
_Entries = tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]


def _tile_entries(
    tile: np.ndarray,
    schedule: AccessSchedule,
    order: np.ndarray,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
    mixes: list[np.ndarray],
) -> _Entries:
    """The entries of one tile's rows: its recursion over all n steps, on its own."""
    n = schedule.steps
    np_dtype = noise.np_dtype
    slots_ = mechanism.bands - 1
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
    # acc += f_t * float64(w_t), as two rounded operations into one reused buffer (the
    # cast is exact; no fused multiply-add), so no temporaries per step
    term = np.empty((k, dim), dtype=np.float64)
    cols: list[np.ndarray] = []
    rows_out: list[np.ndarray] = []
    vals: list[np.ndarray] = []
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
        np.copyto(term, w.numpy().reshape(k, dim))
        np.multiply(term, float(factors[t]), out=term)
        np.add(acc, term, out=acc)
    cols.append(np.full(k, n, dtype=np.int64))
    rows_out.append(trows)
    vals.append((-acc).astype(np_dtype))
    return cols, rows_out, vals
