"""The ring history contract: `HostRing` (dp) and `TieredHistory` (tiers) both satisfy
`RingHistory`, and the correlated noise is bit-identical over either, one tier or
several, with a resume from one onto the other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cocoon_ckpt import BandMF, BandMFNoise
from cocoon_ckpt.dp.noise import bandmf_step
from cocoon_ckpt.dp.ring import HostRing, RingHistory
from cocoon_ckpt.tiers import DeviceTier, HostTier, TieredHistory

KEY = bytes(range(32))
U = 1 << 16  # one noise block: the tiers' smallest allocation unit


def test_both_histories_satisfy_the_protocol() -> None:
    tiered = TieredHistory.single_host(3, 10, "float32")
    try:
        assert isinstance(HostRing(3, 10, "float32"), RingHistory)
        assert isinstance(tiered, RingHistory)
    finally:
        tiered.close()


def test_default_history_is_a_host_ring() -> None:
    cn = BandMFNoise(BandMF.banded_sqrt(4, 10), 50, KEY, 1.0)
    assert isinstance(cn.history, HostRing)
    assert cn.history.placement() == [{"tier": "host", "start": 0, "stop": 50}]
    assert cn.history_bytes() == 3 * 50 * 4


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("bands", [1, 2, 7])
def test_noise_over_tiered_history_equals_host_ring(bands: int, dtype: str) -> None:
    mech = BandMF.banded_sqrt(bands, 30)
    dim = 777
    single = TieredHistory.single_host(bands - 1, dim, dtype)
    ref = BandMFNoise(mech, dim, KEY, 1.3, dtype)
    tiered = BandMFNoise(mech, dim, KEY, 1.3, dtype, history=single)
    try:
        assert single.placement() == ref.history.placement()
        for _ in range(20):
            assert torch.equal(ref.step(), tiered.step())
        assert np.array_equal(ref.history.gather(), single.gather())
    finally:
        tiered.close()
        ref.close()


def test_noise_over_two_tiers_equals_host_ring_and_resumes_across() -> None:
    mech = BandMF.banded_sqrt(6, 40)
    dim = U + 321
    two = TieredHistory(
        5, dim, "float32", [DeviceTier(1 << 30), HostTier(1 << 30)], {"device": 1, "host": 1}, U
    )
    ref = BandMFNoise(mech, dim, KEY, 0.9)
    tiered = BandMFNoise(mech, dim, KEY, 0.9, history=two)
    try:
        for _ in range(9):
            assert torch.equal(ref.step(), tiered.step())
        # a tiered run's state resumes on a plain host ring, bit for bit
        resumed = BandMFNoise(mech, dim, KEY, 0.9)
        resumed.load_state_dict(tiered.state_dict())
        for _ in range(9):
            w = ref.step()
            assert torch.equal(w, tiered.step())
            assert torch.equal(w, resumed.step())
    finally:
        tiered.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bandmf_step_is_the_dense_solve(dtype: torch.dtype) -> None:
    mech = BandMF.banded_sqrt(4, 12)
    rng = np.random.default_rng(0)
    z = torch.from_numpy(rng.standard_normal((12, 5))).to(dtype)
    ring = HostRing(3, 5, "float64" if dtype == torch.float64 else "float32")
    seen: list[int] = []
    got = torch.stack([bandmf_step(mech, t, z[t], ring, after_gemv=seen.append) for t in range(12)])
    want = torch.linalg.solve_triangular(
        torch.from_numpy(mech.matrix(12)).to(dtype), z, upper=False
    )
    torch.testing.assert_close(got, want)
    assert seen == list(range(12))


def test_host_ring_refuses_bad_shapes_and_use_after_close() -> None:
    ring = HostRing(2, 4, "float64")
    with pytest.raises(ValueError, match="float32 or float64"):
        HostRing(2, 4, "int32")
    with pytest.raises(ValueError, match=r"\(3,\)"):
        ring.write(0, np.zeros(3))
    with pytest.raises(IndexError, match="slot 2"):
        ring.read(2)
    with pytest.raises(ValueError, match="history"):
        ring.scatter(np.zeros((3, 4)))
    ring.write(1, np.arange(4.0))
    assert np.array_equal(ring.read(1), np.arange(4.0))
    ring.close()
    ring.close()
    with pytest.raises(ValueError, match="closed"):
        ring.gemv(np.ones(2))
