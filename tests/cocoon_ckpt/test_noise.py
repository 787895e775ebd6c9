import secrets

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from cocoon_ckpt import BLOCK, BandMF, BandMFNoise, KeyedNoise, StateSchemaError

KEY = bytes(range(32))


@pytest.mark.parametrize("bands", [1, 2, 8, 32])
def test_w_equals_dense_triangular_solve(bands: int) -> None:
    n = 200
    m = BandMF.banded_sqrt(bands, n)
    cn = BandMFNoise(m, 300, KEY, 1.3, "float64")
    got = torch.stack([cn.step() for _ in range(n)])
    z = torch.stack([cn.fresh_noise.fresh(t) for t in range(n)])
    ref = torch.linalg.solve_triangular(torch.from_numpy(m.matrix(n)), z, upper=False)
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)


@given(
    bands=st.integers(1, 32),
    n=st.integers(1, 120),
    dim=st.integers(1, 50),
    optimized=st.booleans(),
)
def test_w_equals_dense_solve_property(bands: int, n: int, dim: int, optimized: bool) -> None:
    assume(bands <= n)
    m = BandMF.optimized(bands, n, max_iter=20) if optimized else BandMF.banded_sqrt(bands, n)
    cn = BandMFNoise(m, dim, KEY, 1.0, "float64")
    got = torch.stack([cn.step() for _ in range(n)])
    assert torch.allclose(got, cn.materialize(n), atol=1e-10, rtol=0)


@given(
    cuts=st.lists(st.integers(0, 3 * BLOCK + 17), min_size=1, max_size=6),
    t=st.integers(0, 10_000),
)
def test_fresh_shards_agree_with_the_whole(cuts: list[int], t: int) -> None:
    dim = 3 * BLOCK + 17
    kn = KeyedNoise(KEY, dim, 0.7)
    whole = kn.fresh(t)
    edges = sorted({0, dim, *cuts})
    parts = [kn.fresh(t, a, b) for a, b in zip(edges, edges[1:], strict=False)]
    assert torch.equal(torch.cat(parts), whole)


def test_fresh_is_a_pure_function_of_key_t_block() -> None:
    a, b = KeyedNoise(KEY, 1000, 1.0), KeyedNoise(KEY, 1000, 1.0)
    b.fresh(5)
    assert torch.equal(a.fresh(3), b.fresh(3))
    assert not torch.equal(a.fresh(3), a.fresh(4))
    other = KeyedNoise(secrets.token_bytes(32), 1000, 1.0)
    assert not torch.equal(a.fresh(3), other.fresh(3))
    z = KeyedNoise(KEY, 2 * BLOCK, 1.0).fresh(0)
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1.0) < 0.02


def test_key_is_validated_and_never_shown() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        KeyedNoise(b"short", 10, 1.0)
    kn = KeyedNoise(KEY, 10, 1.0)
    assert KEY.hex() not in repr(kn) and "secret" in repr(kn)


def test_state_dict_resume_mid_run_is_bit_identical() -> None:
    m = BandMF.banded_sqrt(8, 40)
    a = BandMFNoise(m, 500, KEY, 1.0)
    ref = [a.step() for _ in range(40)]
    b = BandMFNoise(m, 500, KEY, 1.0)
    for _ in range(13):
        b.step()
    c = BandMFNoise(m, 500, KEY, 1.0)
    c.load_state_dict(b.state_dict())
    rest = [c.step() for _ in range(27)]
    assert all(torch.equal(x, y) for x, y in zip(ref[13:], rest, strict=True))
    with pytest.raises(StateSchemaError, match="BandMFNoise"):
        c.load_state_dict({"kind": "Accountant", "schema_version": 1})


def test_shard_ranges_compose_to_the_whole_mechanism() -> None:
    m = BandMF.banded_sqrt(4, 20)
    whole = BandMFNoise(m, 1000, KEY, 1.0)
    lo = BandMFNoise(m, 1000, KEY, 1.0, start=0, stop=400)
    hi = BandMFNoise(m, 1000, KEY, 1.0, start=400, stop=1000)
    for _ in range(20):
        assert torch.equal(torch.cat([lo.step(), hi.step()]), whole.step())
