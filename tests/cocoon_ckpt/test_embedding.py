"""I5 at the table level: coalesced noise lands where per-step noisy SGD with the dense
mechanism puts it; the precompute is independent of tiling; the CSC holds exactly the
cold reads and tails; lazy b=1 noise has the per-step noise's distribution, and the
same shortcut at b > 1 does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt import BandMF
from cocoon_ckpt.embedding import (
    AccessSchedule,
    LazyNoise,
    TableEngine,
    TableMode,
    TablePlan,
    TableSpec,
    UnitCosts,
    choose_threshold,
    precompute_csc,
    table_noise,
)
from cocoon_ckpt.examples.dlrm import CRITEO_KAGGLE_ROWS, table_rows, zipf_ids

KEY = bytes(range(32))
SPEC = TableSpec(param="emb.weight", data_index=0, column=0)


def _engine(
    sched: AccessSchedule,
    mech: BandMF,
    dim: int,
    dtype: torch.dtype,
    lrs: np.ndarray,
    batch: int,
    mode: TableMode,
    hot: int,
    tile_rows: int | None = None,
) -> TableEngine:
    plan = TablePlan(mode, hot, None, {})
    return TableEngine(
        SPEC, sched.rows, dim, mech, KEY, 0.7, dtype, sched, lrs / batch, plan, tile_rows
    )


def _sgd_run(
    sched: AccessSchedule,
    mech: BandMF,
    dim: int,
    dtype: torch.dtype,
    lrs: np.ndarray,
    mode: TableMode,
    hot: int,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-step SGD whose gradient depends on the rows read: (rows read per step, final)."""
    batch = 3
    weight = torch.randn(sched.rows, dim, generator=torch.Generator().manual_seed(5), dtype=dtype)
    eng = _engine(sched, mech, dim, dtype, lrs, batch, mode, hot)
    if eng.needs_precompute:
        eng.precompute()
    reads = []
    for t in range(sched.steps):
        eng.before_read(t, weight)
        rows = torch.from_numpy(sched.rows_at(t))
        cur = weight[rows].clone()
        reads.append(cur)
        grad = torch.sin(3 * cur) + 0.1
        if mode is TableMode.DENSE:
            weight.add_(eng.dense_grad(rows, grad) / batch, alpha=-float(lrs[t]))
        else:
            eng.sgd_update(weight, rows, grad, float(lrs[t]), batch)
    eng.finish(weight)
    return reads, weight


@st.composite
def schedules(draw: st.DrawFn) -> tuple[AccessSchedule, BandMF, np.ndarray, int]:
    rows = draw(st.integers(1, 12))
    steps = draw(st.integers(1, 10))
    bands = draw(st.integers(1, min(steps, 5)))
    per = [
        np.array(draw(st.lists(st.integers(0, rows - 1), max_size=6)), dtype=np.int64)
        for _ in range(steps)
    ]
    lrs = np.array(draw(st.lists(st.floats(0.05, 2.0), min_size=steps, max_size=steps)))
    threshold = draw(st.integers(0, steps + 1))
    return (
        AccessSchedule.from_step_rows(rows, per),
        BandMF.banded_sqrt(bands, steps),
        lrs,
        threshold,
    )


@given(case=schedules(), dim=st.sampled_from([1, 3]))
def test_i5_coalesced_reads_equal_per_step_dense_sgd(
    case: tuple[AccessSchedule, BandMF, np.ndarray, int], dim: int
) -> None:
    sched, mech, lrs, threshold = case
    hot = int(np.count_nonzero(sched.counts > threshold))
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        ref_reads, ref_final = _sgd_run(sched, mech, dim, dtype, lrs, TableMode.DENSE, sched.rows)
        reads, final = _sgd_run(sched, mech, dim, dtype, lrs, TableMode.COALESCED, hot)
        scale = max(1.0, float(ref_final.abs().max()))
        for t, (a, b) in enumerate(zip(ref_reads, reads, strict=True)):
            torch.testing.assert_close(b, a, rtol=rtol, atol=rtol * scale, msg=f"step {t}")
        torch.testing.assert_close(final, ref_final, rtol=rtol, atol=rtol * scale)


def _zipf_schedule(rows: int, steps: int, per_step: int, seed: int) -> AccessSchedule:
    rng = np.random.default_rng(seed)
    return AccessSchedule.from_step_rows(
        rows, [zipf_ids(rows, per_step, 1.2, rng) for _ in range(steps)]
    )


def test_precompute_bit_identical_across_tilings_and_orders() -> None:
    sched = _zipf_schedule(rows=400, steps=9, per_step=40, seed=0)
    mech = BandMF.banded_sqrt(4, 9)
    dim, hot = 4, 13
    order = sched.noise_order()
    noise = table_noise(KEY, "emb.weight", sched.rows, dim, 0.7, torch.float32)
    f = np.linspace(0.1, 0.5, 9)

    def run(**kw: object) -> tuple[np.ndarray, ...]:
        csc = precompute_csc(sched, order, hot, dim, mech, noise, f, **kw)  # type: ignore[arg-type]
        return csc.col_ptr, csc.rows, csc.values

    ref = run(tile_rows=sched.rows)
    cold = np.arange(hot, sched.rows)
    shuffled = np.random.default_rng(3).permutation(cold)
    variants = {
        "tile 1": run(tile_rows=1),
        "tile 7": run(tile_rows=7),
        "tile 1024": run(tile_rows=1024),
        "default": run(),
        "tiles in reverse order": run(
            tiles=[cold[i : i + 100] for i in range(0, cold.size, 100)][::-1]
        ),
        "rows permuted across tiles": run(tiles=np.array_split(shuffled, 11)),
    }
    for name, got in variants.items():
        for a, b in zip(ref, got, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name


def test_csc_holds_exactly_the_cold_reads_and_tails() -> None:
    sched = _zipf_schedule(rows=500, steps=12, per_step=30, seed=1)
    mech = BandMF.banded_sqrt(3, 12)
    dim, threshold = 2, 3
    hot = int(np.count_nonzero(sched.counts > threshold))
    order = sched.noise_order()
    hot_rows = set(order[:hot].tolist())
    assert hot_rows == set(np.flatnonzero(sched.counts > threshold).tolist())
    noise = table_noise(KEY, "emb.weight", sched.rows, dim, 1.0, torch.float64)
    csc = precompute_csc(sched, order, hot, dim, mech, noise, np.ones(12))
    cold_reads = 0
    for t in range(sched.steps):
        rows, _ = csc.column(t)
        expect = [r for r in sched.rows_at(t).tolist() if r not in hot_rows]
        assert rows.tolist() == expect, f"column {t}"
        cold_reads += len(expect)
    tails, _ = csc.column(sched.steps)
    assert tails.tolist() == sorted(set(range(sched.rows)) - hot_rows)
    assert csc.nnz == cold_reads + (sched.rows - hot)
    assert not hot_rows & set(csc.rows.tolist())


def test_unread_rows_get_their_whole_noise_as_a_tail() -> None:
    sched = AccessSchedule.from_step_rows(4, [np.array([0]), np.array([0]), np.array([])])
    mech = BandMF.banded_sqrt(2, 3)
    reads, final = _sgd_run(sched, mech, 2, torch.float64, np.ones(3), TableMode.COALESCED, 0)
    ref_reads, ref_final = _sgd_run(sched, mech, 2, torch.float64, np.ones(3), TableMode.DENSE, 4)
    torch.testing.assert_close(final, ref_final, rtol=1e-12, atol=1e-12)


# lazy noise (b = 1) --------------------------------------------------------------------
def test_lazy_matches_dense_dp_sgd_in_distribution() -> None:
    """Over many rows (independent coordinates of one key), the lazy update of a gap
    equals the sum of per-step DP-SGD updates in mean, variance and (zero)
    cross-covariance between coordinates and between a row's gaps."""
    steps, dim, std, trials = 6, 4, 1.3, 4000
    factors = np.array([0.5, 0.2, 0.3, 0.7, 0.1, 0.4])
    # every row is read at step 2 and step 4: gaps [0, 2), [2, 4) and the tail [4, 6)
    gaps = [(0, 2), (2, 4), (4, 6)]
    rows = np.arange(trials)
    lazy = np.stack(
        [
            LazyNoise(KEY, dim, std, factors).updates(
                rows, np.full(trials, j), np.full(trials, a), b
            )
            for j, (a, b) in enumerate(gaps)
        ],
        axis=1,
    )
    z = table_noise(KEY, "emb.weight", trials, dim, std, torch.float64)
    per_step = np.stack([z.fresh(t).numpy().reshape(trials, dim) for t in range(steps)])
    dense = np.stack(
        [-(factors[a:b, None, None] * per_step[a:b]).sum(axis=0) for a, b in gaps], axis=1
    )
    var_true = np.array([(factors[a:b] ** 2).sum() * std**2 for a, b in gaps])
    for sample in (lazy, dense):
        flat = sample.reshape(trials, -1)
        cov = np.cov(flat, rowvar=False)
        # sampling error of a variance with 4000 draws: about 2.2 %; 12 % is > 5 sigma
        np.testing.assert_allclose(np.diag(cov), np.repeat(var_true, dim), rtol=0.12)
        off = cov - np.diag(np.diag(cov))
        assert np.abs(off).max() < 0.1 * var_true.max()
        assert np.abs(flat.mean(axis=0)).max() < 5 * np.sqrt(var_true.max() / trials)


def test_lazy_is_a_pure_function_of_key_row_and_gap() -> None:
    f = np.full(10, 0.1)
    a = LazyNoise(KEY, 5, 1.0, f).updates(np.array([3, 7]), np.array([2, 0]), np.array([1, 0]), 6)
    b = LazyNoise(KEY, 5, 1.0, f).updates(np.array([7, 3]), np.array([0, 2]), np.array([0, 1]), 6)
    assert np.array_equal(a, b[::-1])
    c = LazyNoise(bytes(32), 5, 1.0, f).updates(np.array([3]), np.array([2]), np.array([1]), 6)
    assert not np.array_equal(a[:1], c)


def test_lazy_shortcut_is_wrong_at_b_above_1() -> None:
    """Why the precompute exists: at b > 1 the per-step noise of a gap is correlated, so
    its sum is not one Gaussian of k times the variance."""
    steps, bands, trials = 8, 8, 4000
    mech = BandMF.banded_sqrt(bands, steps)
    z = table_noise(KEY, "emb.weight", trials, 1, 1.0, torch.float64)
    zs = torch.stack([z.fresh(t) for t in range(steps)])  # (steps, trials)
    c = torch.from_numpy(mech.matrix(steps))
    sums = torch.linalg.solve_triangular(c, zs, upper=False).sum(dim=0).numpy()
    ones = np.linalg.inv(mech.matrix(steps)).sum(axis=0)
    exact = float(ones @ ones)  # Var(sum_t w_t) = ||1^T C^-1||^2
    shortcut = steps / float(mech.coefficients[0]) ** 2  # k independent draws, var 1/c0^2
    measured = float(sums.var())
    assert measured == pytest.approx(exact, rel=0.1)
    assert measured < 0.5 * shortcut, (measured, shortcut)


def test_lazy_mode_refuses_bands_above_1() -> None:
    sched = AccessSchedule.from_step_rows(3, [np.array([0])] * 4)
    with pytest.raises(ValueError, match="lazy.*bands=1"):
        _engine(sched, BandMF.banded_sqrt(2, 4), 2, torch.float32, np.ones(4), 1, TableMode.LAZY, 0)


# the profile-driven choice -----------------------------------------------------------
def test_threshold_choice_minimises_the_cost_model_and_turns_coalescing_off() -> None:
    counts = np.array([50, 40, 9, 3, 2, 1, 1, 0, 0, 0])
    costs = UnitCosts(online_s=1.0, entry_s=2.0)
    h, rec = choose_threshold(counts, steps=50, dim=1, costs=costs)
    brute = min(
        range(0, 51),
        key=lambda x: (
            np.count_nonzero(counts > x) + 2.0 * counts[counts <= x].sum() / 50,
            x,
        ),
    )
    cost = lambda x: np.count_nonzero(counts > x) + 2.0 * counts[counts <= x].sum() / 50  # noqa: E731
    assert h is not None and cost(h) == pytest.approx(cost(brute))
    assert rec["predicted_coalesced_s"] < rec["predicted_dense_s"]
    # entries far dearer than online work: coalescing does not pay, the table stays dense
    # (every row read: unread rows cost nothing coalesced, only their tail)
    read = np.maximum(counts, 1)
    h_off, rec_off = choose_threshold(read, steps=50, dim=1, costs=UnitCosts(1.0, 1e6))
    assert h_off is None and rec_off["predicted_coalesced_s"] > 0.9 * rec_off["predicted_dense_s"]


# synthetic data ------------------------------------------------------------------------
def test_zipf_ids_follow_the_power_law_and_scale_to_1e7_rows() -> None:
    rng = np.random.default_rng(0)
    ids = zipf_ids(10**7, 2_000_000, 1.1, rng)
    assert ids.min() >= 0 and ids.max() < 10**7
    counts = np.bincount(ids[ids < 4], minlength=4)
    # the continuous power law x^-1.1 on [1, R + 1), floored: P(k) ~ (k+1)^a - (k+2)^a
    a = -0.1
    p = np.array([(k + 1) ** a - (k + 2) ** a for k in range(4)])
    np.testing.assert_allclose(counts[1:] / counts[0], p[1:] / p[0], rtol=0.05)


def test_criteo_kaggle_shape_scaled() -> None:
    assert len(CRITEO_KAGGLE_ROWS) == 26 and sum(CRITEO_KAGGLE_ROWS) == 33762577
    rows = table_rows("criteo-kaggle", 1e-3)
    assert len(rows) == 26 and rows[2] == 10131 and min(rows) == 1
    with pytest.raises(ValueError, match="criteo-kaggle"):
        table_rows("criteo", 1.0)
