"""Precompute a table's coalesced noise, tile by tile over rows, before step 0.

For a tile of cold rows the BandMF recursion runs over all steps with the same keyed
fresh noise the online mechanism would draw (I1). What a row receives between two reads
is summed, scaled by -lr_s / B per step, into one entry applied just before the next
read; what follows its last read is its tail (column n). Each coordinate's arithmetic
is elementwise and in a fixed order, so the entries are bit-identical for any tiling
and any order of tiles.

The recursion is `dp.noise.bandmf_step`'s arithmetic, compiled into one pass per step
chunk (`cocoon_ckpt.embedding._tile_kernel`, which says why and what it saved);
tests/cocoon_ckpt/test_precompute_kernel.py keeps the per-step `bandmf_step` loop as
the reference and compares every entry bit for bit. A tile draws the fresh noise of a
chunk of steps (`STEP_CHUNK_BYTES`), then the kernel runs those steps; the fresh noise
is now most of the precompute's time.

Tiles are independent, so several run at once, one thread each (numpy's generators
and the compiled kernel release the GIL while they work on arrays), with the same
bits. Each worker draws its noise on one thread: one tile at a time on torch's
intra-op threads leaves the Python-side work serial and waits at their barriers, which
stall when other processes share the cores.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from cocoon_ckpt.dp.generator import NoiseRng
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.schedule import AccessSchedule
from state import hooks

__all__ = [
    "AFTER_TILE",
    "TileEntries",
    "TileLayout",
    "TileParts",
    "default_threads",
    "default_tile_rows",
    "precompute_csc",
    "precompute_into",
    "table_key",
    "table_noise",
]

#: A precompute tile's history aims at this many bytes (fits a large L2 / L3 slice).
TILE_HISTORY_BYTES = 8 << 20

#: A step chunk's fresh noise (its steps x the tile's width) aims at this many bytes:
#: the tile kernel then reads the ring from memory once per chunk, not once per step.
STEP_CHUNK_BYTES = 16 << 20

AFTER_TILE = hooks.declare(
    "precompute.after_tile",
    "a precompute tile's entries computed (and, with a store, handed to its writer: "
    "precompute.tile_kept says durable); step = tiles this call has computed so far, "
    "tile = its index",
)

#: One tile's entries: (columns, rows, values) = ((E,) int64, (E,) int64, (E, dim)).
TileEntries = tuple[np.ndarray, np.ndarray, np.ndarray]

#: A tile whose entries went to the sink (`precompute_csc(sink=...)`): done, not kept.
_HANDED: TileEntries = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 0)))


@dataclass(frozen=True, slots=True)
class TileLayout:
    """What a tile's entries must look like, known before any is read: `entries` of
    them (one per read of its rows, and a tail per row), `dim` wide, in `dtype`."""

    entries: int
    dim: int
    dtype: np.dtype[Any]


class TileParts(Protocol):
    """Where a precompute keeps its finished tiles (`embedding.stored_tiles` keeps them
    in the store), so that a precompute stopped halfway resumes from them.

    Tile `index` is the index-th of the precompute's tiles (in slot order) and `slots`
    its slots; the entries are those `precompute_csc` computes for it, bit for bit.
    """

    def load(self, index: int, slots: np.ndarray, like: TileLayout) -> TileEntries | None:
        """The stored entries of tile `index`, or None: never stored, not trusted, or
        not of the layout `like` this tile's entries have (then it is computed again)."""

    def save(self, index: int, slots: np.ndarray, entries: TileEntries) -> None:
        """Keep tile `index`'s entries durably, now or on a writer of its own (called in
        the caller's thread, once per computed tile, in the order tiles finish)."""


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


def _single_threaded() -> None:
    # A tile worker draws its fresh noise with one thread, so two tiles use two cores
    # and not four threads: torch's thread count belongs to the calling thread (OpenMP),
    # so the caller's own is untouched, and the keyed fresh noise asks torch how many
    # threads it has. The tile kernel itself is serial.
    torch.set_num_threads(1)


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
    parts: TileParts | None = None,
) -> CoalescedCSC:
    """The coalesced entries of every cold row of one table.

    Tiles are independent (each runs its own rows' recursion over all n steps), so
    `threads` of them run at once; every entry is the same bits for any thread count,
    because an entry's arithmetic never involves another tile and the CSC is sorted by
    (column, row) whatever order the tiles finish in. With `parts`, a tile already kept
    there is loaded instead of computed, and each computed tile is kept as it finishes:
    a precompute stopped halfway loses only the tiles in flight, and the CSC is the
    same bits (the parts are the same entries, assembled in tile order).

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
        progress: called (in the caller's thread) with the slots finished after each tile
            (loaded ones first).
        threads: tiles computed at once, each on one thread (None: `default_threads()`;
            1: in the caller's thread, the fresh noise on the caller's torch threads).
        parts: where finished tiles are kept and found (None: nowhere).

    Returns:
        The CSC, columns 0..n-1 and the tails in column n.

    Raises:
        ValueError: `factors` is shorter than the run, `threads` < 1, or a tile holds a
            hot slot.
    """
    entries = _entries(
        schedule, order, hot, dim, mechanism, noise, factors, tile_rows, tiles, progress,
        threads, parts, None,
    )  # fmt: skip
    n = schedule.steps
    if not entries:
        return CoalescedCSC(
            np.zeros(n + 2, np.int64), np.zeros(0, np.int64), np.zeros((0, dim), noise.np_dtype)
        )
    return CoalescedCSC.from_entries(
        n,
        np.concatenate([p[0] for p in entries]),
        np.concatenate([p[1] for p in entries]),
        np.concatenate([p[2] for p in entries]),
    )


def precompute_into(
    sink: Callable[[TileEntries], None],
    schedule: AccessSchedule,
    order: np.ndarray,
    hot: int,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
    *,
    tile_rows: int | None = None,
    progress: Callable[[int], None] | None = None,
    threads: int | None = None,
    parts: TileParts | None = None,
) -> None:
    """`precompute_csc`, each tile's entries (loaded from `parts` or computed) handed
    to `sink` in the caller's thread and let go, instead of kept to build the CSC in
    memory (`embedding.csc_assembly` sorts them on disk)."""
    _entries(
        schedule, order, hot, dim, mechanism, noise, factors, tile_rows, None, progress,
        threads, parts, sink,
    )  # fmt: skip


def _entries(
    schedule: AccessSchedule,
    order: np.ndarray,
    hot: int,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
    tile_rows: int | None,
    tiles: Sequence[np.ndarray] | None,
    progress: Callable[[int], None] | None,
    threads: int | None,
    parts: TileParts | None,
    sink: Callable[[TileEntries], None] | None,
) -> list[TileEntries]:
    """Every tile's entries (none with `sink`: each handed to it); `precompute_csc`."""
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
    consts = _constants(mechanism, n, factors, np_dtype)

    def run(tile: np.ndarray) -> TileEntries:
        return _tile_entries(tile, schedule, order, dim, noise, consts)

    done: list[TileEntries | None] = [None] * len(todo)
    if parts is not None:
        reads = np.diff(schedule.row_ptr)
        for i, tile in enumerate(todo):
            like = TileLayout(int(reads[order[tile]].sum()) + tile.size, dim, np_dtype)
            got = parts.load(i, tile, like)
            if got is not None and sink is not None:
                sink(got)
                got = _HANDED  # let go: the loaded tiles are never all in memory
            done[i] = got
            if got is not None and progress is not None:
                progress(tile.size)
    pending = [i for i, d in enumerate(done) if d is None]
    computed = [0]

    def finish(i: int, entries: TileEntries) -> None:
        if parts is not None:
            parts.save(i, todo[i], entries)
        if sink is not None:
            sink(entries)
        done[i] = entries if sink is None else _HANDED
        computed[0] += 1
        hooks.point(AFTER_TILE, step=computed[0], tile=i)
        if progress is not None:
            progress(todo[i].size)

    if workers == 1 or len(pending) < 2:
        for i in pending:
            finish(i, run(todo[i]))
    else:
        _run_pool(min(workers, len(pending)), pending, lambda i: run(todo[i]), finish)
    return [d for d in done if d is not None and d is not _HANDED]


def _run_pool(
    workers: int,
    pending: list[int],
    run: Callable[[int], TileEntries],
    finish: Callable[[int, TileEntries], None],
) -> None:
    """Tiles `pending` on `workers` threads, each finished one handed to `finish` in the
    caller's thread as soon as it is done (not in tile order: a tile kept as it ends is
    not lost waiting for a slower one before it). At most 2 x `workers` tiles are
    submitted ahead of `finish`, and a tile's entries go once handed on: with every tile
    submitted at once, the workers ran ahead of a slower `finish` (the store's writes)
    and each future kept its result to the pool's end, up to the whole CSC. An error in
    a worker or in `finish` (a fenced writer, a crash point) cancels the tiles not yet
    started and is raised once the running ones end."""
    ahead = 2 * workers
    todo = iter(pending)
    with ThreadPoolExecutor(
        workers, thread_name_prefix="cocoon-pre", initializer=_single_threaded
    ) as pool:
        futures: dict[Future[TileEntries], int] = {}

        def feed() -> None:
            for i in itertools.islice(todo, max(ahead - len(futures), 0)):
                futures[pool.submit(run, i)] = i

        try:
            feed()
            while futures:
                finished, _ = wait(futures, return_when=FIRST_COMPLETED)
                for fut in sorted(finished, key=futures.__getitem__):
                    finish(futures.pop(fut), fut.result())
                del finished, fut  # their entries go before the next tiles are computed
                feed()
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise


@dataclass(frozen=True, slots=True)
class _Constants:
    """What every tile's recursion shares, in the forms the kernel takes."""

    mixes: np.ndarray
    """(n, b-1) mixing vectors, cast to the noise dtype as `HostRing.gemv` casts them."""
    c0: np.floating[Any]
    """c_0 in the noise dtype (torch divides a tensor by a Python float in its dtype)."""
    scales: np.ndarray
    """(n,) s_t in the noise dtype (1.0 but for a column-normalized C's tail)."""
    factors: np.ndarray
    """(n,) float64 lr_t / B."""


def _constants(mechanism: BandMF, n: int, factors: np.ndarray, dtype: np.dtype[Any]) -> _Constants:
    slots = mechanism.bands - 1
    mixes = np.zeros((n, slots), dtype=dtype)
    for t in range(n if slots else 0):
        mixes[t] = mechanism.mixing_vector(t).astype(dtype)
    return _Constants(
        mixes=mixes,
        c0=dtype.type(float(mechanism.coefficients[0])),
        scales=np.array([mechanism.noise_scale(t) for t in range(n)], dtype=dtype),
        factors=np.ascontiguousarray(factors[:n], dtype=np.float64),
    )


def _tile_entries(
    tile: np.ndarray,
    schedule: AccessSchedule,
    order: np.ndarray,
    dim: int,
    noise: KeyedNoise,
    consts: _Constants,
) -> TileEntries:
    """The entries of one tile's rows: its recursion over all n steps, on its own, in
    step chunks whose fresh noise fits `STEP_CHUNK_BYTES`."""
    from cocoon_ckpt.embedding._tile_kernel import CHUNK_COLUMNS, tile_steps

    n = schedule.steps
    np_dtype = noise.np_dtype
    k = tile.size
    width = k * dim
    trows = order[tile]
    lo, hi = int(tile.min()) * dim, (int(tile.max()) + 1) * dim
    contiguous = hi - lo == width and bool(np.all(np.diff(tile) == 1))
    coords = (
        None
        if contiguous
        else torch.from_numpy((tile[:, None] * dim + np.arange(dim) - lo).ravel())
    )
    # this tile's reads, row by row: positions in row_steps without a loop per row
    starts, stops = schedule.row_ptr[trows], schedule.row_ptr[trows + 1]
    lens = stops - starts
    ev_ptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    idx = np.arange(int(ev_ptr[-1]), dtype=np.int64) + np.repeat(starts - ev_ptr[:-1], lens)
    ev_steps = np.ascontiguousarray(schedule.row_steps[idx], dtype=np.int64)
    nxt = ev_ptr[:-1].copy()
    out = np.empty((ev_steps.size, dim), dtype=np_dtype)
    ring = np.zeros(consts.mixes.shape[1] * width, dtype=np_dtype)
    acc = np.zeros(width, dtype=np.float64)
    span = max(1, min(n, STEP_CHUNK_BYTES // max(1, width * np_dtype.itemsize)))
    z = np.empty(span * width, dtype=np_dtype)
    chunk_rows = max(1, CHUNK_COLUMNS // dim)
    for t0 in range(0, n, span):
        t1 = min(t0 + span, n)
        for t in range(t0, t1):
            zt = noise.fresh(t, lo, hi)
            if coords is not None:
                zt = zt[coords]
            z[(t - t0) * width : (t - t0 + 1) * width] = zt.numpy()
        tile_steps(
            z[: (t1 - t0) * width], t0, ring, acc, consts.mixes, consts.c0, consts.scales,
            consts.factors, ev_ptr, ev_steps, nxt, out, dim, chunk_rows,
        )  # fmt: skip
    tails = (-acc).astype(np_dtype).reshape(k, dim)
    cols = np.concatenate([ev_steps, np.full(k, n, dtype=np.int64)])
    rows_out = np.concatenate([np.repeat(trows, lens), trows])
    return cols, rows_out, np.concatenate([out, tails])
