"""The BandMF step computed in its ring slot (`bandmf_step_in_slot`, `BandMFNoise.step`
with `out` on a ring that is one host array, #31 item 2), fused into one compiled pass
or through a kept scratch: w_t, the ring and a trainer's parameters equal the step
through the caller's and the noise's kept (width,) buffers bit for bit (any width, band
count, dtype, generator, chunking, thread count, shard start, past the ring's wrap); a
lent ring row is copied out before any byte of its slot changes; the crash points fire
while the slot is unchanged; and the step allocates no (width,) buffer, the fused one
nothing but one noise block's buffer a thread (tracemalloc sees every numpy buffer;
the caller's `out` and the kept h are never touched)."""

from __future__ import annotations

import dataclasses
import tracemalloc
from typing import Any

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK, KeyedNoise, bandmf_step, bandmf_step_in_slot
from cocoon_ckpt.dp.ring import HostRing, RingHistory
from cocoon_ckpt.format.snapshot import SharedRows, lend_row
from cocoon_ckpt.tiers import DeviceTier, HostTier, TieredHistory
from cocoon_ckpt.train.runner import build_trainer
from fault_injection import CrashPointHit, crash_at, disarm_all

from .conftest import job_config

KEY = bytes(range(32))
NEVER = 1 << 62  # a slot_min_width no width reaches: every step through the kept buffers


def _pair(
    mech: BandMF,
    width: int,
    start: int,
    dtype: str,
    rng: str,
    parts: int,
    tiered: bool,
    fuse: bool = False,
) -> tuple[BandMFNoise, BandMFNoise]:
    """(in the slot, through the kept buffers) over the same key and shard; in the slot
    fused (`fuse`, the default generator) or through a scratch of `parts` parts."""
    dim = start + width + 5
    ring: RingHistory = (
        TieredHistory.single_host(mech.bands - 1, width, dtype)
        if tiered
        else HostRing(mech.bands - 1, width, dtype)
    )
    fused = BandMFNoise(mech, dim, KEY, 1.3, dtype, start=start, stop=start + width, history=ring)
    fused.slot_min_width, fused.slot_part_width = 1, -(-width // parts)
    fused.slot_fused_min_elements = 1 if fuse else NEVER
    kept = BandMFNoise(mech, dim, KEY, 1.3, dtype, start=start, stop=start + width, rng=rng)
    kept.slot_min_width = NEVER
    fused.fresh_noise = kept.fresh_noise  # the same generator (the rng drawn)
    return fused, kept


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(1, 2 * BLOCK + 9),
    start=st.sampled_from([0, 1, BLOCK - 3, BLOCK]),
    bands=st.integers(2, 5),
    dtype=st.sampled_from(["float32", "float64"]),
    rng=st.sampled_from(["default", "secure"]),
    parts=st.integers(1, 4),
    extra=st.integers(0, 4),
    threads=st.sampled_from([1, 2]),
    tiered=st.booleans(),
    fuse=st.booleans(),
)
def test_the_step_in_the_slot_is_the_kept_buffers_step(
    width: int,
    start: int,
    bands: int,
    dtype: str,
    rng: str,
    parts: int,
    extra: int,
    threads: int,
    tiered: bool,
    fuse: bool,
) -> None:
    mech = BandMF.banded_sqrt(bands, 40)
    fused, kept = _pair(mech, width, start, dtype, rng, parts, tiered, fuse)
    one_pass = fuse and rng == "default"  # the secure generator keeps the scratch
    tdt = getattr(torch, dtype)
    out = torch.full((width,), float("nan"), dtype=tdt)
    kept_out = torch.empty(width, dtype=tdt)
    was, was_numba = torch.get_num_threads(), numba.get_num_threads()
    try:
        for t in range(2 * (bands - 1) + extra):  # past the ring's wrap
            # the draw's blocks, and the fused pass's, on any number of threads
            torch.set_num_threads(threads)
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            w = fused.step(out)
            torch.set_num_threads(1)
            want = kept.step(kept_out)
            assert want is kept_out
            slot = t % (bands - 1)
            ring = fused.history.open_slot(slot)  # type: ignore[attr-defined]
            assert w.data_ptr() == ring[slot].ctypes.data  # w_t is the ring's slot
            assert torch.equal(w, want)
            assert np.array_equal(fused.history.gather(), kept.history.gather())
            assert fused.row_steps() == kept.row_steps() and fused.t == kept.t == t + 1
        assert torch.isnan(out).all()  # the caller's buffer is never touched
        assert fused._h is None  # nor is a (width,) h made
        assert (fused._chunk_h is None) is one_pass  # nor, fused, a scratch
        assert (fused.reserve_scratch() is None) or not one_pass
    finally:
        torch.set_num_threads(was)
        numba.set_num_threads(was_numba)


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(1, 2 * BLOCK + 9),
    start=st.integers(0, BLOCK + 5),
    bands=st.integers(2, 6),
    dtype=st.sampled_from(["float32", "float64"]),
    chunks=st.lists(st.integers(1, 3 * BLOCK), min_size=1, max_size=4),
    steps=st.integers(1, 12),
    optimized=st.booleans(),
    fused=st.sampled_from([None, True, False]),
    threads=st.sampled_from([1, 2]),
)
def test_the_function_is_bandmf_step_in_any_chunking(
    width: int,
    start: int,
    bands: int,
    dtype: str,
    chunks: list[int],
    steps: int,
    optimized: bool,
    fused: bool | None,
    threads: int,
) -> None:
    mech = BandMF.optimized(bands, 16, max_iter=10) if optimized else BandMF.banded_sqrt(bands, 16)
    noise = KeyedNoise(KEY, start + width, 0.9, dtype)
    rows = np.zeros((bands - 1, width), dtype=dtype)
    ring = HostRing(bands - 1, width, dtype)
    scratch = None if fused else np.empty(max(*chunks, width), dtype=dtype)
    was = numba.get_num_threads()
    for t in range(steps):
        # another chunking every step, at most ~40 chunks (a test's time)
        chunk = max(chunks[t % len(chunks)], -(-width // 40))
        # the fused pass's blocks on any number of threads (numba's at most)
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        try:
            w = bandmf_step_in_slot(
                mech, t, noise, start, rows, scratch=scratch, chunk=chunk, fused=fused
            )
        finally:
            numba.set_num_threads(was)
        want = bandmf_step(mech, t, noise.fresh(t, start, start + width), ring)
        assert torch.equal(w, want)
        assert np.array_equal(rows, ring.gather())


def test_the_function_refuses_what_it_cannot_do() -> None:
    noise = KeyedNoise(KEY, 100, 1.0)
    rows = np.zeros((2, 100), dtype=np.float32)
    with pytest.raises(ValueError, match="no ring slot"):
        bandmf_step_in_slot(BandMF.banded_sqrt(1, 5), 0, noise, 0, rows)
    with pytest.raises(ValueError, match="writable C-contiguous"):
        bandmf_step_in_slot(BandMF.banded_sqrt(3, 5), 0, noise, 0, rows.astype(np.float64))
    with pytest.raises(ValueError, match="at least 40"):
        bandmf_step_in_slot(
            BandMF.banded_sqrt(3, 5), 0, noise, 0, rows, scratch=np.empty(39, np.float32), chunk=40
        )
    secure = KeyedNoise(KEY, 100, 1.0, rng="secure")
    with pytest.raises(ValueError, match="fused=True draws the default generator"):
        bandmf_step_in_slot(BandMF.banded_sqrt(3, 5), 0, secure, 0, rows, fused=True)
    assert not rows.any()  # nothing written


def test_steps_without_a_ring_row_keep_the_general_step() -> None:
    # b = 1, a column-normalized tail (s_t != 1), a ring over two tiers, no `out`
    width = 3000
    for mech, history in [
        (BandMF.banded_sqrt(1, 10), None),
        (BandMF.optimized_colnorm(3, 10, max_iter=20), None),
        (
            BandMF.banded_sqrt(3, 10),
            TieredHistory(
                2,
                width,
                "float32",
                [DeviceTier(1 << 20), HostTier(1 << 20)],
                {"device": 1, "host": 1},
                2000,
            ),
        ),
    ]:
        noise = BandMFNoise(mech, width, KEY, 1.0, history=history)
        noise.slot_min_width = 1
        ref = BandMFNoise(mech, width, KEY, 1.0)
        out = torch.empty(width)
        for t in range(10):
            in_slot = mech.bands > 1 and history is None and mech.noise_scale(t) == 1.0
            w = noise.step(out)
            assert torch.equal(w, ref.step())
            if in_slot:
                assert w is not out and np.shares_memory(w.numpy(), noise.history.open_slot(0))  # type: ignore[attr-defined]
            elif mech.noise_scale(t) == 1.0:
                assert w is out  # the caller's buffer, as before
        noise.close()
    # with no `out`, a fresh tensor as before (never a view of the ring)
    plain = BandMFNoise(BandMF.banded_sqrt(3, 10), width, KEY, 1.0)
    plain.slot_min_width = 1
    w = plain.step()
    w.add_(1.0)  # the caller's own tensor: the ring is not changed through it
    assert not np.array_equal(plain.history.read(0), w.numpy())


def _lent(history: TieredHistory, slot: int) -> tuple[SharedRows, str]:
    lender = SharedRows()
    with lender.lending():
        view = lend_row(history, slot)
    assert view is not None
    lender.adopt({"ring/row": view})
    return lender, "ring/row"


def test_a_lent_row_is_copied_out_before_its_slot_changes() -> None:
    mech = BandMF.banded_sqrt(4, 30)
    width = 2 * BLOCK + 5
    fused, kept = _pair(mech, width, 0, "float32", "default", 2, True)
    history = fused.history
    assert isinstance(history, TieredHistory)
    out = torch.empty(width)
    for _ in range(4):  # slot 0 holds w_3
        fused.step(out)
        kept.step()
    lender, name = _lent(history, 0)
    held = history.read(0)
    seen: list[np.ndarray] = []
    history.add_write_guard(lambda slot: seen.append(history.read(slot)))  # after the lender's
    try:
        for _ in range(3):  # w_6 goes into slot 0
            w = fused.step(out)
            assert torch.equal(w, kept.step())
        assert len(seen) == 3 and np.array_equal(seen[2], held)  # guards ran, slot unchanged
        copied = lender.claim(name)
        # copied out: the ring's row moved on
        assert copied is not None and not np.shares_memory(copied, w.numpy())
        assert np.array_equal(copied[0], held)
        assert np.array_equal(history.read(0), w.numpy())
    finally:
        lender.release()


def test_a_row_being_written_is_waited_for() -> None:
    # the writer is in slot 0's row: the step waits for it before changing a byte
    import threading

    mech = BandMF.banded_sqrt(2, 30)  # one slot: every step writes slot 0
    width = BLOCK + 3
    fused, kept = _pair(mech, width, 0, "float32", "default", 2, True)
    history = fused.history
    assert isinstance(history, TieredHistory)
    out = torch.empty(width)
    fused.step(out)
    kept.step()
    lender, name = _lent(history, 0)
    row = lender.claim(name)
    assert row is not None
    held = row.copy()
    done = threading.Event()
    result: list[torch.Tensor] = []

    def step() -> None:
        result.append(fused.step(out))
        done.set()

    worker = threading.Thread(target=step)
    worker.start()
    try:
        # the writer reads its row while the step waits: the bytes are the lent ones
        assert np.array_equal(row, held) and not done.is_set()
    finally:
        lender.written(name)
        worker.join()
        lender.release()
    assert torch.equal(result[0], kept.step())


@pytest.mark.parametrize("point", ["noise.before_fresh", "noise.after_fresh", "noise.after_gemv"])
def test_the_crash_points_fire_before_the_slot_changes(point: str) -> None:
    mech = BandMF.banded_sqrt(3, 20)
    width = BLOCK + 99
    fused, kept = _pair(mech, width, 0, "float32", "default", 2, False)
    out = torch.empty(width)
    for _ in range(3):
        fused.step(out)
        kept.step()
    before = fused.history.gather()
    crash_at(point, step=3)
    try:
        with pytest.raises(CrashPointHit, match=point):
            fused.step(out)
    finally:
        disarm_all()
    assert fused.t == 3 and np.array_equal(fused.history.gather(), before)
    assert torch.equal(fused.step(out), kept.step())  # the step taken again is the same


def test_a_step_through_a_scratch_allocates_no_width_buffer() -> None:
    mech = BandMF.banded_sqrt(4, 30)
    width = 16 * BLOCK  # 4 MiB of float32 a row
    fused, _ = _pair(mech, width, 0, "float32", "default", 4, False)  # not fused
    out = torch.full((width,), float("nan"))
    assert fused.reserve_scratch() is not None  # the scratch of one part, made at build
    made = fused._chunk_h
    fused.step(out)  # a process's first step loads (or compiles) the kernels
    row = width * 4
    tracemalloc.start()
    try:
        for _ in range(5):  # past the wrap
            tracemalloc.reset_peak()
            fused.step(out)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak < row // 8, (peak, row)  # the part's h is kept; nothing (width,)
    finally:
        tracemalloc.stop()
    assert fused._chunk_h is made and made is not None and made.nbytes == row // 4  # 1 of 4 parts
    assert fused._h is None and torch.isnan(out).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_fused_step_allocates_one_block_a_thread(dtype: str) -> None:
    mech = BandMF.banded_sqrt(4, 30)
    width = 64 * BLOCK + 7  # 16 MiB of float32 a row
    fused, kept = _pair(mech, width, 0, dtype, "default", 1, False, fuse=True)
    assert fused.reserve_scratch() is None  # nothing to make at build
    out = torch.full((width,), float("nan"), dtype=getattr(torch, dtype))
    item = np.dtype(dtype).itemsize
    # the fused pass's buffers: one noise block a thread, whatever the width
    bound = min(numba.get_num_threads(), 65) * BLOCK * item + (64 << 10)
    assert torch.equal(fused.step(out), kept.step())  # the kernel's first call loads it
    tracemalloc.start()
    try:
        for _ in range(5):  # past the wrap
            tracemalloc.reset_peak()
            w = fused.step(out)
            peak = tracemalloc.get_traced_memory()[1]
            assert peak <= bound, (peak, bound)
            assert torch.equal(w, kept.step())
    finally:
        tracemalloc.stop()
    assert fused._chunk_h is None and fused._h is None and torch.isnan(out).all()


def _trainer(overlap: bool, in_slot: bool) -> Any:
    cfg = dataclasses.replace(job_config("mlp", bands=4, steps=12), overlap_noise=overlap)
    tr = build_trainer(cfg, KEY)
    tr.noise.slot_min_width = 1 if in_slot else NEVER
    return tr


@pytest.mark.parametrize("overlap", [False, True])
def test_a_trainer_in_the_slot_gives_the_same_parameters(overlap: bool) -> None:
    fused, kept = _trainer(overlap, True), _trainer(overlap, False)
    fused._w.fill_(float("nan"))
    try:
        while not kept.done:
            a, b = fused.train_step(), kept.train_step()
            assert (a.loss, a.grad_norm, a.noise_norm) == (b.loss, b.grad_norm, b.noise_norm)
            assert fused.last_noise is not fused._w and kept.last_noise is kept._w
            assert torch.equal(fused.last_noise, kept.last_noise)
            for p, q in zip(fused.model.parameters(), kept.model.parameters(), strict=True):
                assert torch.equal(p, q)
        assert torch.equal(fused.noise.ring, kept.noise.ring)
        assert torch.isnan(fused._w).all()  # the trainer's kept w_t buffer never touched
    finally:
        fused.close()
        kept.close()
