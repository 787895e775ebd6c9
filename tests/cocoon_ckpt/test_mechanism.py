import numpy as np
import pytest

from cocoon_ckpt import BandMF


@pytest.mark.parametrize("bands", [1, 2, 8, 32])
def test_column_norm_is_one_and_matrix_is_banded_toeplitz(bands: int) -> None:
    m = BandMF.banded_sqrt(bands, 64)
    c = m.matrix()
    assert np.linalg.norm(c, axis=0).max() == pytest.approx(1.0, abs=1e-12)
    for t in range(64):
        for s in range(64):
            lag = t - s
            want = m.coefficients[lag] if 0 <= lag < bands else 0.0
            assert c[t, s] == want


def test_banded_sqrt_closed_form() -> None:
    m = BandMF.banded_sqrt(4, 10)
    raw = np.array([1, 1 / 2, 3 / 8, 5 / 16])
    np.testing.assert_allclose(m.coefficients, raw / np.linalg.norm(raw), rtol=1e-14)


def test_dp_sgd_loss_and_dense_reference() -> None:
    n = 50
    assert BandMF.banded_sqrt(1, n).loss() == pytest.approx(n * (n + 1) / 2)
    for bands in (2, 8):
        m = BandMF.optimized(bands, n)
        a = np.tril(np.ones((n, n)))
        dense = np.linalg.norm(a @ np.linalg.inv(m.matrix()), "fro") ** 2
        assert m.loss() == pytest.approx(dense, rel=1e-9)


@pytest.mark.parametrize("bands", [2, 4, 8, 16])
def test_optimized_beats_banded_sqrt(bands: int) -> None:
    sq, opt = BandMF.banded_sqrt(bands, 128), BandMF.optimized(bands, 128)
    assert opt.loss() < sq.loss()
    assert opt.sensitivity == pytest.approx(1.0)
    assert BandMF.optimized(1, 128).loss() == pytest.approx(128 * 129 / 2)


def test_more_bands_lower_error() -> None:
    losses = [BandMF.banded_sqrt(b, 100).loss() for b in (1, 2, 4, 8, 16)]
    assert losses == sorted(losses, reverse=True)


@pytest.mark.parametrize(
    ("bands", "steps", "match"),
    [(0, 10, "bands=0"), (5, 0, "steps=0"), (11, 10, "exceeds steps=10")],
)
def test_bad_arguments_name_the_field(bands: int, steps: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BandMF.banded_sqrt(bands, steps)


def test_state_dict_roundtrip() -> None:
    m = BandMF.optimized(4, 40)
    m2 = BandMF.from_state_dict(m.state_dict())
    np.testing.assert_array_equal(m.coefficients, m2.coefficients)
    assert m2.kind == m.kind


def test_optimized_two_bands_finds_the_one_variable_optimum() -> None:
    # At n = 1500 a first L-BFGS step in c lands at c_1 >= 1, where C^-1 grows like
    # c_1^n; the optimiser must still find the interior optimum, not return the sqrt.
    from scipy.optimize import minimize_scalar

    n = 1500

    def loss(c1: float) -> float:
        return BandMF(np.array([1.0, c1]), steps=n).loss()

    ref = minimize_scalar(loss, bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-9})
    m = BandMF.optimized(2, n)
    c1 = m.coefficients[1] / m.coefficients[0]
    assert abs(c1 - ref.x) < 1e-3
    assert m.loss() <= ref.fun * (1 + 1e-9)
    assert m.loss() < 0.95 * BandMF.banded_sqrt(2, n).loss()


@pytest.mark.parametrize("steps", [16, 64, 200])
@pytest.mark.parametrize("bands", [2, 3, 5, 8])
def test_optimized_is_a_local_minimum(bands: int, steps: int) -> None:
    m = BandMF.optimized(bands, steps)
    assert m.loss() <= BandMF.banded_sqrt(bands, steps).loss()
    rng = np.random.default_rng(1000 * bands + steps)
    c = m.coefficients / m.coefficients[0]
    for scale in (1e-2, 1e-3):
        for _ in range(4):
            near = c + scale * np.concatenate([[0.0], rng.standard_normal(bands - 1)])
            # Stable: no root of 1 + c_1 z + ... in the closed unit disc, so C^-1 stays bounded.
            assert np.all(np.abs(np.roots(near[::-1])) > 1.0)
            assert m.loss() <= BandMF(near, steps=steps).loss() * (1 + 1e-10)


def test_optimized_is_deterministic() -> None:
    a, b = BandMF.optimized(16, 300), BandMF.optimized(16, 300)
    assert a.coefficients.tobytes() == b.coefficients.tobytes()


def test_error_gradient_matches_dense_loss_and_finite_differences() -> None:
    from cocoon_ckpt.dp.mechanism import _error_and_gradient

    rng = np.random.default_rng(7)
    n = 40
    for bands in (2, 5, 9):
        c = np.concatenate([[1.0], 0.3 * rng.standard_normal(bands - 1)])
        loss, grad = _error_and_gradient(c, n)
        assert loss == pytest.approx(BandMF(c, steps=n).loss(), rel=1e-12)
        h = 1e-6
        for i in range(bands):
            step = np.zeros(bands)
            step[i] = h
            fd = (_error_and_gradient(c + step, n)[0] - _error_and_gradient(c - step, n)[0]) / (
                2 * h
            )
            assert grad[i] == pytest.approx(fd, rel=1e-6, abs=1e-6 * abs(loss))


def test_reflection_coefficients_round_trip_to_stable_polynomials() -> None:
    from cocoon_ckpt.dp.mechanism import (
        _polynomial_to_reflection,
        _reflection_to_polynomial,
        _reflection_vjp,
    )

    rng = np.random.default_rng(3)
    for m in (1, 4, 12):
        k = np.tanh(2.0 * rng.standard_normal(m))
        c, padded = _reflection_to_polynomial(k)
        assert c[0] == 1.0
        assert np.all(np.abs(np.roots(c[::-1])) > 1.0)
        np.testing.assert_allclose(_polynomial_to_reflection(c), k, atol=1e-9)
        # The vector-Jacobian product against central differences of a linear functional.
        g = rng.standard_normal(m + 1)
        vjp = _reflection_vjp(k, padded, g)
        for i in range(m):
            dk = np.zeros(m)
            dk[i] = 1e-6
            fd = (
                g @ _reflection_to_polynomial(k + dk)[0] - g @ _reflection_to_polynomial(k - dk)[0]
            ) / 2e-6
            assert vjp[i] == pytest.approx(fd, rel=1e-6, abs=1e-8)
