"""The compiled precompute equals, bit for bit, the per-step loop it replaced: the
online mechanism's own `bandmf_step` over a `HostRing` per tile, its output scaled by
lr_t / B and summed in float64 between reads (the reference below, the precompute as it
was before the kernel)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt import BandMF
from cocoon_ckpt.dp.mechanism import MechanismKind
from cocoon_ckpt.dp.noise import KeyedNoise, bandmf_step
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.embedding import AccessSchedule, CoalescedCSC, precompute_csc, table_noise
from cocoon_ckpt.embedding import precompute as precompute_module
from cocoon_ckpt.examples.dlrm import zipf_ids

KEY = bytes(range(32))


def _reference_tile(
    tile: np.ndarray,
    schedule: AccessSchedule,
    order: np.ndarray,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = schedule.steps
    np_dtype = noise.np_dtype
    slots = mechanism.bands - 1
    k = tile.size
    trows = order[tile]
    lo, hi = int(tile.min()) * dim, (int(tile.max()) + 1) * dim
    coords = torch.from_numpy((tile[:, None] * dim + np.arange(dim) - lo).ravel())
    hist = HostRing(slots, k * dim, np_dtype)
    acc = np.zeros((k, dim), dtype=np.float64)
    cols, rows_out, vals = [], [], []
    for t in range(n):
        z = noise.fresh(t, lo, hi)[coords]
        mix = mechanism.mixing_vector(t).astype(np_dtype) if slots else None
        w = bandmf_step(mechanism, t, z, hist, mix=mix)
        sel = np.flatnonzero(np.isin(trows, schedule.rows_at(t)))
        cols.append(np.full(sel.size, t, dtype=np.int64))
        rows_out.append(trows[sel])
        vals.append((-acc[sel]).astype(np_dtype))
        acc[sel] = 0.0
        term = w.numpy().reshape(k, dim).astype(np.float64)
        acc += term * float(factors[t])
    cols.append(np.full(k, n, dtype=np.int64))
    rows_out.append(trows)
    vals.append((-acc).astype(np_dtype))
    return np.concatenate(cols), np.concatenate(rows_out), np.concatenate(vals)


def _reference(
    schedule: AccessSchedule,
    order: np.ndarray,
    dim: int,
    mechanism: BandMF,
    noise: KeyedNoise,
    factors: np.ndarray,
    tiles: list[np.ndarray],
) -> CoalescedCSC:
    parts = [_reference_tile(t, schedule, order, dim, mechanism, noise, factors) for t in tiles]
    return CoalescedCSC.from_entries(
        schedule.steps, *(np.concatenate([p[i] for p in parts]) for i in range(3))
    )


def _assert_same(a: CoalescedCSC, b: CoalescedCSC) -> None:
    for name, x in a.arrays().items():
        y = b.arrays()[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        # bytes, so that -0.0 and 0.0 (an entry closed before any noise) count as different
        assert x.tobytes() == y.tobytes(), f"{name} differs"


MECHANISMS: dict[str, Callable[[int, int], BandMF]] = {
    "sqrt": BandMF.banded_sqrt,
    # a column-normalized C (s_t != 1 in the last b-1 steps) without optimizing one
    "colnorm": lambda b, n: BandMF(
        BandMF.banded_sqrt(b, n).coefficients, steps=n, kind=MechanismKind.OPTIMIZED_COLNORM
    ),
    "custom": lambda b, n: BandMF(np.linspace(3.0, 0.2, b), steps=n),
}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 200),
    steps=st.integers(1, 12),
    bands=st.integers(1, 9),
    dim=st.sampled_from([1, 3, 16]),
    tiles=st.integers(1, 4),
    hot_frac=st.floats(0.0, 0.9),
    kind=st.sampled_from(sorted(MECHANISMS)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    chunk_bytes=st.sampled_from([1, 200, 1 << 24]),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_equals_the_per_step_loop(
    rows: int,
    steps: int,
    bands: int,
    dim: int,
    tiles: int,
    hot_frac: float,
    kind: str,
    dtype: torch.dtype,
    chunk_bytes: int,
    shuffle: bool,
    seed: int,
) -> None:
    bands = min(bands, steps)
    rng = np.random.default_rng(seed)
    sched = AccessSchedule.from_step_rows(
        rows, [zipf_ids(rows, 15, 1.2, rng) for _ in range(steps)]
    )
    mech = MECHANISMS[kind](bands, steps)
    f = rng.uniform(0.01, 0.3, steps)
    noise = table_noise(KEY, "emb.weight", rows, dim, 0.7, dtype)
    order = sched.noise_order()
    hot = min(int(hot_frac * rows), rows - 1)
    cold = np.arange(hot, rows, dtype=np.int64)
    if shuffle:
        cold = rng.permutation(cold)
    split = [t for t in np.array_split(cold, tiles) if t.size]
    ref = _reference(sched, order, dim, mech, noise, f, split)
    # step chunks of one step up to the whole run: the ring and sums carry across
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precompute_module, "STEP_CHUNK_BYTES", chunk_bytes)
        got = precompute_csc(sched, order, hot, dim, mech, noise, f, tiles=split, threads=1)
    _assert_same(ref, got)


def test_kernel_equals_the_per_step_loop_on_a_wide_tile() -> None:
    # several column chunks and a ring the old loop ran the compiled GEMV over
    steps, bands, dim, rows = 9, 8, 16, 5000
    rng = np.random.default_rng(7)
    sched = AccessSchedule.from_step_rows(
        rows, [zipf_ids(rows, 900, 1.1, rng) for _ in range(steps)]
    )
    mech = MECHANISMS["colnorm"](bands, steps)
    f = np.linspace(0.01, 0.3, steps)
    noise = table_noise(KEY, "emb.weight", rows, dim, 1.3, torch.float32)
    order = sched.noise_order()
    ref = _reference(sched, order, dim, mech, noise, f, [np.arange(40, rows)])
    got = precompute_csc(sched, order, 40, dim, mech, noise, f, threads=2)
    _assert_same(ref, got)
