"""The compiled fixed-order GEMV equals the numpy reference bit for bit: any shape, slot
count, column slice of a wider ring, rotated mixing vector, block size, thread count,
dtype, caller thread and memory map; and it never fuses a multiply with an add."""

from __future__ import annotations

import threading
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt.dp import _gemv_kernel
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS, mix_history, mix_history_reference

THREADS = sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)})


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(max_examples=60)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    slots=st.integers(1, 13),
    width=st.integers(0, 700),
    col_offset=st.integers(0, 9),
    extra_cols=st.integers(0, 5),
    row_step=st.sampled_from([1, 2]),
    head=st.integers(0, 12),
    block_items=st.sampled_from([1, 3, 16, 100, 1 << 20]),
    threads=st.sampled_from(THREADS),
    seed=st.integers(0, 2**32 - 1),
)
def test_compiled_equals_reference_bit_for_bit(
    dtype: type,
    slots: int,
    width: int,
    col_offset: int,
    extra_cols: int,
    row_step: int,
    head: int,
    block_items: int,
    threads: int,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    # The ring as a tier or a rank sees it: a column slice of a wider history, possibly
    # every other row of it, the mixing vector rotated to the ring's head.
    parent = rng.standard_normal((slots * row_step, col_offset + width + extra_cols))
    parent *= rng.choice([1e-30, 1e-3, 1.0, 1e30], size=parent.shape)
    ring = parent.astype(dtype)[::row_step, col_offset : col_offset + width]
    mix = np.roll(rng.standard_normal(slots), head % slots)
    want = mix_history_reference(mix, ring)
    old_block, old_threads = _gemv_kernel.BLOCK_BYTES, numba.get_num_threads()
    try:
        _gemv_kernel.BLOCK_BYTES = block_items * np.dtype(dtype).itemsize
        numba.set_num_threads(threads)
        got = mix_history(mix, ring, compiled=True)
    finally:
        _gemv_kernel.BLOCK_BYTES = old_block
        numba.set_num_threads(old_threads)
    assert _same_bits(got, want)


@pytest.mark.parametrize(
    ("dtype", "eps"), [(np.float32, 2.0**-12), (np.float64, 2.0**-27)], ids=["f32", "f64"]
)
@pytest.mark.parametrize("threads", THREADS)
def test_no_fused_multiply_add(dtype: type, eps: float, threads: int) -> None:
    # a = 1 + eps: a*a = 1 + 2 eps + eps^2, and eps^2 is half an ulp or less, so the
    # rounded product is 1 + 2 eps and (-(1 + 2 eps) + a*a) is exactly 0. An FMA keeps
    # eps^2 and returns it instead; so would any contraction LLVM were allowed.
    a = dtype(1 + eps)
    width = 40_000  # several blocks, both threads
    ring = np.empty((2, width), dtype=dtype)
    ring[0], ring[1] = dtype(1 + 2 * eps), a
    mix = np.array([-1.0, a], dtype=dtype)
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(threads)
        got = mix_history(mix, ring, compiled=True)
    finally:
        numba.set_num_threads(old)
    assert not np.any(got), f"{np.count_nonzero(got)} coordinates kept eps^2: an FMA"
    assert _same_bits(got, mix_history_reference(mix, ring))


def test_default_dispatch_is_by_size_and_either_way_the_same() -> None:
    rng = np.random.default_rng(3)
    ring = rng.standard_normal((3, COMPILED_MIN_ELEMENTS // 3 + 1)).astype(np.float32)
    mix = rng.standard_normal(3)
    want = mix_history_reference(mix, ring)
    assert _same_bits(mix_history(mix, ring), want)
    assert _same_bits(mix_history(mix, ring, compiled=False), want)
    assert _same_bits(mix_history(mix, ring[:, :100]), want[:100])


def test_concurrent_callers_get_the_same_bits() -> None:
    # A tier's pool thread and the trainer may both sum at once: one takes the parallel
    # kernel, the other the serial one; neither may abort or differ.
    rng = np.random.default_rng(4)
    ring = rng.standard_normal((9, 300_000)).astype(np.float32)
    mixes = [rng.standard_normal(9) for _ in range(4)]
    want = [mix_history_reference(m, ring) for m in mixes]
    got: list[list[np.ndarray]] = [[] for _ in mixes]

    def run(k: int) -> None:
        for _ in range(5):
            got[k].append(mix_history(mixes[k], ring, compiled=True))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(mixes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(len(mixes)):
        assert len(got[k]) == 5 and all(_same_bits(g, want[k]) for g in got[k])


def test_memory_maps_and_strided_out(tmp_path: Path) -> None:
    # The far worker maps its shard read-only and writes into a mapped output file.
    rng = np.random.default_rng(5)
    data = rng.standard_normal((6, 5000)).astype(np.float64)
    path = tmp_path / "ring.bin"
    data.tofile(path)
    ring = np.memmap(path, dtype=np.float64, mode="r", shape=data.shape)
    out = np.memmap(tmp_path / "out.bin", dtype=np.float64, mode="w+", shape=(5000,))
    mix = rng.standard_normal(6)
    want = mix_history_reference(mix, data)
    mix_history(mix, ring, out, compiled=True)
    assert _same_bits(np.asarray(out), want)
    strided = np.zeros(10_000, dtype=np.float64)
    mix_history(mix, ring, strided[::2], compiled=True)
    assert _same_bits(strided[::2].copy(), want) and not np.any(strided[1::2])


def test_other_dtypes_and_bad_mix() -> None:
    ring = np.arange(12, dtype=np.float16).reshape(3, 4)
    mix = np.array([0.5, -1.0, 2.0])
    assert _same_bits(mix_history(mix, ring, compiled=True), mix_history_reference(mix, ring))
    with pytest.raises(ValueError, match="3 slots"):
        mix_history(np.ones(2), ring.astype(np.float32), compiled=True)
    empty = mix_history(np.ones(0), np.empty((0, 5), dtype=np.float32), compiled=True)
    assert _same_bits(empty, np.zeros(5, dtype=np.float32))
