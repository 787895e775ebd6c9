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
