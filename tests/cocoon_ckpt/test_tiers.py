"""Tiers: any split, any mode gives the single-tier w bit for bit; the planner is the
brute-force optimum; capacities are enforced; a dying far worker never yields a wrong
result; the tiers run at once; a resume on other tiers is bit-identical."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt import BandMF, BandMFNoise, run_job
from cocoon_ckpt.dp.gemv import mix_history, mix_history_torch
from cocoon_ckpt.tiers import (
    DeviceTier,
    FarTier,
    GemvMode,
    HostTier,
    TierCapacityError,
    TierConfig,
    TieredHistory,
    TierError,
    build_history,
    capacity_units,
    plan_units,
)
from cocoon_ckpt.tiers.base import TierKind
from cocoon_ckpt.train.options import JobOptions
from state import Store

from .conftest import job_config

U = 1 << 16  # one noise block: the smallest allocation unit


def _history(counts: dict[str, int], slots: int, width: int, mode: GemvMode) -> TieredHistory:
    make = {
        "device": lambda: DeviceTier(1 << 31),
        "host": lambda: HostTier(1 << 31),
        "far": lambda: FarTier(1 << 31),
    }
    names = [n for n in ("device", "host", "far") if n in counts]
    return TieredHistory(slots, width, "float32", [make[n]() for n in names], counts, U, mode=mode)


@pytest.fixture(scope="module")
def ring_and_mix() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    ring = rng.standard_normal((5, 3 * U + 101)).astype(np.float32)
    mix = rng.standard_normal(5)
    return ring, mix, mix_history(mix, ring)


def test_kernel_is_split_and_backend_invariant() -> None:
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        ring = rng.standard_normal((9, 2 * U + 33)).astype(dtype)
        mix = rng.standard_normal(9)
        whole = mix_history(mix, ring)
        # a BLAS GEMV agrees to rounding, not bit for bit: that is why the kernel exists
        blas = mix.astype(dtype) @ ring
        eps = np.finfo(dtype).eps
        np.testing.assert_allclose(whole, blas, rtol=0, atol=20 * eps * np.abs(mix).sum() * 5)
        for cut in (1, 77, U, U + 5):
            parts = np.concatenate(
                [mix_history(mix, ring[:, :cut]), mix_history(mix, ring[:, cut:])]
            )
            assert np.array_equal(parts, whole)
        on_torch = mix_history_torch(mix, torch.from_numpy(ring)).numpy()
        assert np.array_equal(on_torch, whole)


@given(
    counts=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    mode=st.sampled_from(list(GemvMode)),
    slots=st.integers(1, 6),
)
def test_any_split_and_mode_is_bit_identical(
    counts: tuple[int, int], mode: GemvMode, slots: int
) -> None:
    units = 4
    dev, host = counts
    far = units - dev - host
    from hypothesis import assume

    assume(far >= 0)
    width = 3 * U + 101
    rng = np.random.default_rng(slots)
    ring = rng.standard_normal((slots, width)).astype(np.float32)
    mix = rng.standard_normal(slots)
    split = {"device": dev, "host": host, "far": far}
    h = _history(split, slots, width, mode)
    try:
        h.scatter(ring)
        assert np.array_equal(h.gemv(mix), mix_history(mix, ring))
        assert np.array_equal(h.gather(), ring)
        assert sum(p["stop"] - p["start"] for p in h.placement()) == width
    finally:
        h.close()


def test_correlated_noise_on_tiers_equals_single_host() -> None:
    mech = BandMF.banded_sqrt(6, 40)
    dim = 2 * U + 999
    key = bytes(range(32))
    ref = BandMFNoise(mech, dim, key, 1.3)
    tiered = BandMFNoise(
        mech,
        dim,
        key,
        1.3,
        history=_history({"device": 1, "host": 1, "far": 1}, 5, dim, GemvMode.NEAR_DATA),
    )
    try:
        for _ in range(12):
            assert torch.equal(ref.step(), tiered.step())
        dense = ref.materialize(12)
        np.testing.assert_allclose(tiered.ring.numpy(), ref.ring.numpy(), rtol=0, atol=0)
        assert dense.shape == (12, dim)
    finally:
        tiered.close()


def _brute_force(units: int, sec: dict[str, float], cap: dict[str, int]) -> float:
    names = list(cap)
    best = float("inf")
    for combo in itertools.product(*(range(min(cap[n], units) + 1) for n in names)):
        if sum(combo) == units:
            best = min(best, max(k * sec[n] for k, n in zip(combo, names, strict=True)))
    return best


@given(
    units=st.integers(0, 14),
    sec=st.tuples(*[st.floats(1e-4, 1.0) for _ in range(3)]),
    cap=st.tuples(*[st.integers(0, 14) for _ in range(3)]),
)
def test_planner_is_the_brute_force_optimum(
    units: int, sec: tuple[float, float, float], cap: tuple[int, int, int]
) -> None:
    names = ("device", "host", "far")
    seconds = dict(zip(names, sec, strict=True))
    caps = dict(zip(names, cap, strict=True))
    if sum(cap) < units:
        with pytest.raises(TierCapacityError, match=f"{units - sum(cap)} missing"):
            plan_units(units, seconds, caps)
        return
    counts = plan_units(units, seconds, caps)
    assert sum(counts.values()) == units
    assert all(counts[n] <= caps[n] for n in names)
    got = max((counts[n] * seconds[n] for n in names), default=0.0)
    assert got <= _brute_force(units, seconds, caps) * (1 + 1e-9)


def test_capacities_are_enforced_with_what_is_missing() -> None:
    # device: the merge buffer (the whole result) comes first
    with pytest.raises(TierCapacityError, match="merge buffer of 1048576 bytes"):
        capacity_units(TierKind.DEVICE, 1000, slots=3, unit=U, itemsize=4, units=4)
    assert (
        capacity_units(
            TierKind.DEVICE, 4 * U * 4 + 2 * 3 * U * 4, slots=3, unit=U, itemsize=4, units=4
        )
        == 2
    )
    with pytest.raises(TierCapacityError, match="bytes missing"):
        build_history(7, 5 * U, "float32", TierConfig(host_bytes=8 << 20))
    with pytest.raises(TierCapacityError, match="needs"):
        HostTier(10).allocate(2, 10, "float32")
    h = build_history(7, 5 * U, "float32", TierConfig(host_bytes=3 * 7 * U * 4, far_bytes=1 << 30))
    try:
        assert h.plan is not None and h.plan["counts"]["host"] <= 3
        assert sum(h.plan["counts"].values()) == 5 and h.plan["predicted_s"] > 0
        assert {p["tier"] for p in h.placement()} == {"host", "far"}
    finally:
        h.close()


def test_far_worker_killed_mid_gemv_is_replaced_and_recomputed(
    ring_and_mix: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ring, mix, want = ring_and_mix
    far = FarTier(1 << 30, max_respawns=1)
    h = TieredHistory(5, ring.shape[1], "float32", [far], {"far": 4}, U)
    try:
        h.scatter(ring)
        assert np.array_equal(h.gemv(mix), want)
        far.pre_delay_s = 0.5
        pid = far.worker_pid
        assert pid is not None
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
        assert np.array_equal(h.gemv(mix), want)  # recomputed by the replacement
        assert far.respawns == 1 and far.worker_pid != pid
        # no replacement left: a clear error, never a result
        threading.Timer(0.2, os.kill, (far.worker_pid, signal.SIGKILL)).start()
        with pytest.raises(TierError, match="replacement"):
            h.gemv(mix)
    finally:
        h.close()


def test_tiers_compute_at_the_same_time(
    ring_and_mix: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    ring, mix, want = ring_and_mix
    far = FarTier(1 << 30)
    host = HostTier(1 << 30)
    h = TieredHistory(5, ring.shape[1], "float32", [host, far], {"host": 2, "far": 2}, U)
    try:
        h.scatter(ring)
        far.pre_delay_s = 0.3  # the far worker is busy for 0.3 s
        t0 = time.perf_counter()
        assert np.array_equal(h.gemv(mix), want)
        elapsed = time.perf_counter() - t0
        (hs, he), (fs, fe) = host.last_interval, far.last_interval  # type: ignore[misc]
        # the host computed while the far request was outstanding
        assert fs <= hs and he <= fe
        assert elapsed < 0.3 + (he - hs) + 0.25
    finally:
        h.close()


def test_far_tier_is_owner_only_and_removed_on_close(tmp_path: Path) -> None:
    far = FarTier(1 << 30, folder=str(tmp_path))
    far.allocate(2, 1000, "float32")
    (private,) = list(tmp_path.iterdir())
    assert oct(private.stat().st_mode & 0o777) == "0o700"
    assert oct((private / "history").stat().st_mode & 0o777) == "0o600"
    far.close()
    assert not list(tmp_path.iterdir())


def test_resume_on_other_tiers_is_bit_identical(tmp_path: Path) -> None:
    """Crash a job whose history lies on the host, resume it on device + host + far
    tiers (re-planned), and it ends on the uninterrupted run's model bit for bit."""
    plain = job_config("mlp", bands=4, steps=12)
    key = str(tmp_path / "noise.key")  # one key for both runs: the same noise
    ref_url = str(tmp_path / "ref.zarr")
    run_job(plain, ref_url, options=JobOptions(key_file=key))
    url = str(tmp_path / "t.zarr")
    run_job(plain, url, stop_after=7, options=JobOptions(key_file=key))
    tiered = job_config(
        "mlp",
        bands=4,
        steps=12,
        tiers=TierConfig(
            device_bytes=1 << 26, host_bytes=0, far_bytes=1 << 30, counts={"device": 0, "far": 1}
        ),
    )
    res = run_job(tiered, url, options=JobOptions(key_file=key))
    assert res.resumed_from == 5
    a = Store.open(ref_url, create=False).latest()
    b = Store.open(url, create=False).latest()
    assert a is not None and b is not None
    for name in a.array_names():
        if name.startswith("model/") or name.startswith("ring/"):
            assert np.array_equal(a.array(name), b.array(name)), name
    assert b.records["noise"]["placement"] == [
        {"tier": "far", "start": 0, "stop": b.records["noise"]["dim"]}
    ]
    assert b.records["noise"]["plan"]["counts"] == {"device": 0, "far": 1}


def test_far_link_throttle_charges_what_crosses(
    ring_and_mix: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """A pull of the shard crosses the link: it takes at least bytes / bandwidth. The near
    GEMV moves only the mixing vector and the result: (1 + slots) x fewer bytes."""
    ring, mix, want = ring_and_mix
    bw = 40e6  # bytes/s: the 5 x 196709 float32 shard takes ~0.1 s to pull
    far = FarTier(1 << 30, link_bytes_per_s=bw)
    h = TieredHistory(5, ring.shape[1], "float32", [far], {"far": 4}, U)
    try:
        h.scatter(ring)
        t0 = time.perf_counter()
        pulled = far.pull()
        pull_s = time.perf_counter() - t0
        assert np.array_equal(pulled, ring) and pull_s >= ring.nbytes / bw
        t0 = time.perf_counter()
        assert np.array_equal(h.gemv(mix), want)
        near_s = time.perf_counter() - t0
        assert near_s >= (ring.shape[1] + 5) * 4 / bw
    finally:
        h.close()
