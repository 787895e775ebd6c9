"""The column-normalized banded strategy (`optimized_colnorm`) against dense references
and jax_privacy's numbers (tests/cocoon_ckpt/golden/colnorm_jax_privacy.json, written by
bench/colnorm_reference.py; the command is in the file)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cocoon_ckpt.dp.column_normalized import column_normalized_loss, column_scales
from cocoon_ckpt.dp.mechanism import BandMF, MechanismKind
from cocoon_ckpt.dp.plan import plan

GOLDEN = json.loads((Path(__file__).parent / "golden" / "colnorm_jax_privacy.json").read_text())
SMALL = [(1, 5), (2, 9), (3, 3), (4, 17), (8, 40), (16, 20)]


def _dense_loss(c: np.ndarray, n: int) -> float:
    a = np.tril(np.ones((n, n)))
    return float(np.sum((a @ np.linalg.inv(c[:n, :n])) ** 2))


@pytest.mark.parametrize(("bands", "steps"), SMALL)
def test_matrix_is_banded_with_unit_columns_and_toeplitz_up_to_the_tail(
    bands: int, steps: int
) -> None:
    toeplitz = BandMF.optimized(bands, steps)
    cn = BandMF.column_normalize(toeplitz)
    c = cn.matrix()
    assert np.array_equal(c, np.tril(np.triu(c, -(bands - 1))))  # lower, b-banded
    np.testing.assert_allclose(np.linalg.norm(c, axis=0), 1.0, rtol=1e-14)
    # Columns holding every band are the Toeplitz ones bit for bit, as are the bands.
    full = steps - bands + 1
    assert np.array_equal(c[:, :full], toeplitz.matrix()[:, :full])
    assert np.array_equal(cn.coefficients, toeplitz.coefficients)


@pytest.mark.parametrize(("bands", "steps"), SMALL)
def test_sensitivity_under_min_separation_is_the_toeplitz_one(bands: int, steps: int) -> None:
    """What the amplified accounting uses: columns b or more apart never share a row and
    no column is longer than 1, so k participations b apart have sensitivity sqrt(k)."""
    c = BandMF.optimized_colnorm(bands, steps).matrix()
    gram = c.T @ c
    far = np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands
    assert np.all(gram[far] == 0.0)
    assert np.max(np.linalg.norm(c, axis=0)) <= 1.0 + 1e-15


@pytest.mark.parametrize(("bands", "steps"), SMALL)
def test_noise_is_the_scaled_toeplitz_recursion(bands: int, steps: int) -> None:
    """C^-1 z = diag(s) C_T^-1 z: the ring keeps the Toeplitz recursion, each output is
    multiplied by `noise_scale(t)` (1.0 exactly until the last b-1 steps)."""
    cn = BandMF.optimized_colnorm(bands, steps)
    c = cn.coefficients
    z = np.random.default_rng(bands * 100 + steps).standard_normal((steps, 3))
    x = np.zeros_like(z)
    w = np.zeros_like(z)
    for t in range(steps):
        x[t] = (z[t] - sum(c[j] * x[t - j] for j in range(1, min(t, bands - 1) + 1))) / c[0]
        w[t] = cn.noise_scale(t) * x[t]
    np.testing.assert_allclose(w, np.linalg.solve(cn.matrix(), z), rtol=1e-9, atol=1e-12)
    scales = [cn.noise_scale(t) for t in range(steps)]
    assert scales[: steps - bands + 1] == [1.0] * (steps - bands + 1)
    assert all(s < 1.0 for s in scales[steps - bands + 1 :])
    assert [BandMF.optimized(bands, steps).noise_scale(t) for t in range(steps)] == [1.0] * steps


@pytest.mark.parametrize(("bands", "steps"), SMALL)
def test_loss_is_the_dense_workload_error(bands: int, steps: int) -> None:
    cn = BandMF.optimized_colnorm(bands, steps)
    for n in sorted({1, steps // 2 + 1, steps - 1, steps} - {0}):
        assert cn.loss(n) == pytest.approx(_dense_loss(cn.matrix(), n), rel=1e-12)
    assert cn.loss() <= BandMF.optimized(bands, steps).loss()


def test_scales_follow_the_truncated_column_norms() -> None:
    c = BandMF.optimized(4, 10).coefficients
    toeplitz = BandMF(c, steps=10).matrix()
    want = np.linalg.norm(toeplitz, axis=0) / np.linalg.norm(c)
    want[:7] = 1.0
    np.testing.assert_allclose(column_scales(c, 10), want, rtol=1e-15)


@pytest.mark.parametrize("row", GOLDEN["settings"], ids=lambda r: f"n{r['n']}-b{r['bands']}")
def test_against_jax_privacy(row: dict[str, object]) -> None:
    n, b = int(row["n"]), int(row["bands"])  # type: ignore[call-overload]
    theirs = np.array(row["coefficients"])
    # Our loss of their coefficients is theirs: the formula, checked independently.
    assert column_normalized_loss(theirs, n) == pytest.approx(row["colnorm_loss"], rel=1e-9)
    assert BandMF(theirs, steps=n).loss() == pytest.approx(row["toeplitz_loss"], rel=1e-9)
    ours = BandMF.optimized_colnorm(b, n).loss()
    assert ours <= float(row["colnorm_loss"]) * (1 + 1e-6)  # type: ignore[arg-type]


def test_state_dict_round_trip_and_refusals() -> None:
    cn = BandMF.optimized_colnorm(4, 30)
    back = BandMF.from_state_dict(cn.state_dict())
    assert back.kind is MechanismKind.OPTIMIZED_COLNORM and back.is_column_normalized
    assert np.array_equal(back.matrix(), cn.matrix()) and back.loss() == cn.loss()
    with pytest.raises(ValueError, match="optimized only"):
        BandMF.column_normalize(BandMF.banded_sqrt(4, 30))
    with pytest.raises(ValueError, match="steps=30"):
        cn.matrix(31)
    with pytest.raises(ValueError, match="t=30"):
        cn.noise_scale(30)


def test_plan_weighs_it_by_name_at_the_same_sigma() -> None:
    p = plan(
        target_epsilon=8.0,
        delta=1e-5,
        dataset_size=1200,
        batch_size=20,
        steps=128,
        bands=(4,),
        mechanisms=("optimized", "optimized_colnorm"),
    )
    _, opt, cn = p.rows
    assert cn.mechanism is MechanismKind.OPTIMIZED_COLNORM
    assert cn.noise_multiplier == opt.noise_multiplier  # the accounting does not change
    assert cn.predicted_error < opt.predicted_error
    assert p.recommendation is cn
