"""The precompute on several threads equals the one-thread precompute bit for bit: tiles
are independent and the CSC is sorted by (column, row), so neither the thread count nor
the order in which tiles finish can change an entry."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt import BandMF
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS
from cocoon_ckpt.embedding import AccessSchedule, CoalescedCSC, precompute_csc, table_noise
from cocoon_ckpt.examples.dlrm import zipf_ids

KEY = bytes(range(32))


def _case(
    rows: int, steps: int, bands: int, per_step: int, seed: int
) -> tuple[AccessSchedule, BandMF, np.ndarray]:
    rng = np.random.default_rng(seed)
    sched = AccessSchedule.from_step_rows(
        rows, [zipf_ids(rows, per_step, 1.2, rng) for _ in range(steps)]
    )
    return sched, BandMF.banded_sqrt(bands, steps), np.linspace(0.01, 0.3, steps)


def _csc(
    sched: AccessSchedule,
    mech: BandMF,
    f: np.ndarray,
    dim: int,
    hot: int,
    dtype: torch.dtype,
    **kw: object,
) -> CoalescedCSC:
    noise = table_noise(KEY, "emb.weight", sched.rows, dim, 0.7, dtype)
    order = sched.noise_order()
    return precompute_csc(sched, order, hot, dim, mech, noise, f, **kw)  # type: ignore[arg-type]


def _assert_same(a: CoalescedCSC, b: CoalescedCSC, what: str) -> None:
    for name, x in a.arrays().items():
        y = b.arrays()[name]
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: {name}"
        assert np.array_equal(x, y), f"{what}: {name} differs"


@given(
    rows=st.integers(1, 300),
    steps=st.integers(1, 8),
    bands=st.integers(1, 5),
    dim=st.sampled_from([1, 3, 8]),
    tile_rows=st.integers(1, 64),
    threads=st.integers(2, 5),
    hot_frac=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_parallel_precompute_equals_serial(
    rows: int,
    steps: int,
    bands: int,
    dim: int,
    tile_rows: int,
    threads: int,
    hot_frac: float,
    dtype: torch.dtype,
    seed: int,
) -> None:
    bands = min(bands, steps)
    sched, mech, f = _case(rows, steps, bands, 20, seed)
    hot = int(hot_frac * rows)
    serial = _csc(sched, mech, f, dim, hot, dtype, tile_rows=tile_rows, threads=1)
    par = _csc(sched, mech, f, dim, hot, dtype, tile_rows=tile_rows, threads=threads)
    _assert_same(serial, par, f"{threads} threads")


@given(threads=st.integers(2, 4), seed=st.integers(0, 2**16))
def test_parallel_explicit_tiles_in_any_order(threads: int, seed: int) -> None:
    sched, mech, f = _case(200, 6, 3, 30, 1)
    hot = 9
    cold = np.random.default_rng(seed).permutation(np.arange(hot, sched.rows))
    tiles = np.array_split(cold, 7)
    ref = _csc(sched, mech, f, 4, hot, torch.float32, tile_rows=sched.rows, threads=1)
    got = _csc(sched, mech, f, 4, hot, torch.float32, tiles=tiles, threads=threads)
    _assert_same(ref, got, "shuffled tiles")


def test_parallel_with_the_compiled_gemv() -> None:
    # wide tiles (rings the old per-step loop ran the compiled GEMV over): several of
    # the tile kernel's column chunks per tile, workers and the caller alike
    dim, bands = 16, 3
    tile_rows = -(-COMPILED_MIN_ELEMENTS // ((bands - 1) * dim))
    sched, mech, f = _case(2 * tile_rows + 5, 4, bands, 2000, 3)
    serial = _csc(sched, mech, f, dim, 5, torch.float32, tile_rows=tile_rows, threads=1)
    par = _csc(sched, mech, f, dim, 5, torch.float32, tile_rows=tile_rows, threads=2)
    _assert_same(serial, par, "compiled GEMV")


def test_parallel_leaves_the_callers_thread_count_and_reports_progress_in_order() -> None:
    sched, mech, f = _case(120, 5, 3, 20, 2)
    before = torch.get_num_threads()
    seen: list[tuple[int, str]] = []

    def progress(k: int) -> None:
        seen.append((k, threading.current_thread().name))

    _csc(sched, mech, f, 2, 10, torch.float32, tile_rows=25, threads=3, progress=progress)
    assert torch.get_num_threads() == before
    assert sum(k for k, _ in seen) == sched.rows - 10
    assert {name for _, name in seen} == {threading.current_thread().name}


def test_threads_below_one_is_refused() -> None:
    sched, mech, f = _case(10, 3, 2, 5, 0)
    with pytest.raises(ValueError, match="threads=0"):
        _csc(sched, mech, f, 2, 0, torch.float32, threads=0)
