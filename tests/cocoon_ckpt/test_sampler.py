import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt import CyclicPoissonSampler


@given(n=st.integers(10, 500), bands=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_batches_are_pure_and_b_min_separated(n: int, bands: int, seed: int) -> None:
    batch = max(1, n // (bands * 3))
    s = CyclicPoissonSampler(dataset_size=n, batch_size=batch, bands=bands, seed=seed)
    again = CyclicPoissonSampler(dataset_size=n, batch_size=batch, bands=bands, seed=seed)
    last_seen: dict[int, int] = {}
    for t in range(3 * bands):
        b = s.batch(t)
        assert np.array_equal(b, again.batch(t))
        assert np.all(np.diff(b) > 0)
        for i in b.tolist():
            if i in last_seen:
                assert t - last_seen[i] >= bands  # participates at most once per b steps
            last_seen[i] = t
    parts = np.concatenate(s.partitions)
    assert np.array_equal(np.sort(parts), np.arange(n))


def test_expected_batch_size_and_seed_dependence() -> None:
    s = CyclicPoissonSampler(dataset_size=10_000, batch_size=100, bands=4, seed=1)
    sizes = [len(s.batch(t)) for t in range(400)]
    assert abs(np.mean(sizes) - 100) < 3
    other = CyclicPoissonSampler(dataset_size=10_000, batch_size=100, bands=4, seed=2)
    assert not np.array_equal(s.batch(0), other.batch(0))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dataset_size": 0}, "dataset_size=0"),
        ({"bands": 0}, "bands=0"),
        ({"batch_size": 0}, "batch_size=0"),
        ({"batch_size": 30, "bands": 4}, "exceeds dataset_size=100"),
    ],
)
def test_bad_arguments(kw: dict[str, int], match: str) -> None:
    args = {"dataset_size": 100, "batch_size": 10, "bands": 2, "seed": 0, **kw}
    with pytest.raises(ValueError, match=match):
        CyclicPoissonSampler(**args)
