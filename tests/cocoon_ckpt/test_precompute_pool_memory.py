"""The precompute's tile pool lets each finished tile's entries go once it has handed
them on: with two workers it had kept every tile's result to the pool's end, the whole
CSC, which set the memory a windowed job needs (bench/csc_budget.py found it)."""

from __future__ import annotations

import tracemalloc

import numpy as np

from cocoon_ckpt.embedding.precompute import TileEntries, _run_pool

TILE_BYTES = 1 << 20
TILES = 40


def _tile(i: int) -> TileEntries:
    rows = np.full(TILE_BYTES // 8, i, dtype=np.int64)
    return rows, np.zeros(1, np.int64), np.zeros((1, 1))


def test_a_finished_tile_is_let_go_once_handed_on() -> None:
    handed: list[int] = []

    def finish(i: int, entries: TileEntries) -> None:
        assert int(entries[0][0]) == i  # each tile's own entries, handed on once
        handed.append(i)

    tracemalloc.start()
    try:
        _run_pool(2, list(range(TILES)), _tile, finish)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(handed) == list(range(TILES))
    # in flight on two workers, a finished batch being handed on: a few tiles, never all
    assert peak < 8 * TILE_BYTES, peak / TILE_BYTES
