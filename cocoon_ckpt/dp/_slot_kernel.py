"""The BandMF step in its ring slot as one compiled pass (numba), imported by
`cocoon_ckpt.dp.noise.bandmf_step_in_slot` on first use, for the default generator.

For each noise block of the slot's columns, on one thread: the history GEMV of the
block's columns into a buffer of one block (`_gemv_kernel._rows_into`, the GEMV's own
loop: each column summed in the fixed order), which reads w_{t-b+1} where the slot
still holds it; then the block's z_t drawn into the slot's columns
(`_ziggurat_kernel._block_f32` / `_block_f64`, the generator's own loops); then
w = (z - h) / c_0 over them (`elementwise._sub_div`, the step's own loop). The same
functions on the same values in the same order as the three kernels the step ran
before (GEMV into a scratch, draw, subtract and divide), so the same bits, with no
scratch of the width's size: each thread has one block's buffer (256 KiB of float32),
and the h it holds is read back from cache.

Why one launch: every parallel launch ends at a barrier where libgomp (numba's OpenMP
threading layer here) spins; on this 2-core machine shared with other busy processes
a bare launch over two elements took 5-8 ms (the spinning thread waits out its
partner's time slice), against 2-4 us with the threads sleeping
(`OMP_WAIT_POLICY=passive`) and 23 us under numba's workqueue layer. The step through
a scratch pays it twice a chunk (the GEMV and the draw): at 4.2M coordinates (b = 4,
load 1.5) 24 ms in one chunk, 60 ms in 4 chunks of 16 noise blocks, 250 ms in 16 of 4
blocks, the GEMV and the draw each ~7 ms a chunk and the serial division unchanged.
One launch a step pays it once.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cocoon_ckpt.dp._gemv_kernel import BLOCK_BYTES, _parallel_lock, _rows_into
from cocoon_ckpt.dp._ziggurat_kernel import _block_f32, _block_f64
from cocoon_ckpt.dp._ziggurat_tables import (
    FI_DOUBLE,
    FI_FLOAT,
    KI_DOUBLE,
    KI_FLOAT,
    WI_DOUBLE,
    WI_FLOAT,
)
from cocoon_ckpt.dp.elementwise import _sub_div

__all__ = ["step_into_slot"]


@njit(nogil=True, fastmath=False, cache=True)
def _block(j, seeds, first_skip, block, std, wi, ki, fi, f32, mix, flat, rs, row, c0, h, sub):  # type: ignore[no-untyped-def]
    # noise block j covers row[a:z]; the ring's column k is flat[i * rs + k]
    lo = j * block - first_skip
    a = max(lo, 0)
    z = min(lo + block, row.shape[0])
    acc = h[: z - a]
    # the GEMV first: it reads the slot's old values of these columns
    for s in range(0, z - a, sub):
        e = min(s + sub, z - a)
        _rows_into(acc[s:e], mix, flat, rs, a + s, a + e)
    if f32:
        _block_f32(seeds[j], row[a:z], a - lo, std, wi, ki, fi)
    else:
        _block_f64(seeds[j], row[a:z], a - lo, std, wi, ki, fi)
    _sub_div(row[a:z], acc, c0)


@njit(nogil=True, fastmath=False, parallel=True, cache=True)
def _parallel(seeds, first_skip, block, std, wi, ki, fi, f32, mix, flat, rs, row, c0, bufs, sub):  # type: ignore[no-untyped-def]
    # one thread per buffer, every n-th block each: no buffer is shared
    n = bufs.shape[0]
    for k in prange(n):
        for j in range(k, seeds.shape[0], n):
            _block(
                j,
                seeds,
                first_skip,
                block,
                std,
                wi,
                ki,
                fi,
                f32,
                mix,
                flat,
                rs,
                row,
                c0,
                bufs[k],
                sub,
            )


@njit(nogil=True, fastmath=False, cache=True)
def _serial(seeds, first_skip, block, std, wi, ki, fi, f32, mix, flat, rs, row, c0, bufs, sub):  # type: ignore[no-untyped-def]
    for j in range(seeds.shape[0]):
        _block(
            j, seeds, first_skip, block, std, wi, ki, fi, f32, mix, flat, rs, row, c0, bufs[0], sub
        )


def step_into_slot(
    mix: np.ndarray,
    ring: np.ndarray,
    slot: int,
    seeds: np.ndarray,
    first_skip: int,
    std: float,
    c0: float,
    block: int,
) -> None:
    """ring[slot] <- (z - sum_i mix[i] ring[i]) / c0, z the generator's values of the
    blocks `seeds` cut to the ring's columns, scaled by `std`.

    Args:
        mix: (S,) C-contiguous, ring's dtype (float32 or float64), S >= 1.
        ring: (S, W) columns of a ring with contiguous rows (a column slice of a wider
            one works), row `slot` writable.
        slot: the row that is the step's w_t.
        seeds: (blocks, 3) uint64, each block's SFC64 seed words.
        first_skip: values of the first block before the ring's first column.
        std: the noise's standard deviation, applied in the ring's dtype.
        c0: the divisor, applied in the ring's dtype.
        block: values per noise block.
    """
    slots, width = ring.shape
    if width == 0:
        return
    dt = ring.dtype
    item = dt.itemsize
    rs = ring.strides[0] // item if slots > 1 else width
    # the GEMV's read-only view from ring[0, 0] to ring[S-1, W-1] (`_gemv_kernel.mix_into`)
    flat = np.lib.stride_tricks.as_strided(
        ring.view(np.ndarray), shape=((slots - 1) * rs + width,), strides=(item,), writeable=False
    )
    row = ring[slot].view(np.ndarray)
    f32 = dt == np.float32
    tables = (WI_FLOAT, KI_FLOAT, FI_FLOAT) if f32 else (WI_DOUBLE, KI_DOUBLE, FI_DOUBLE)
    sub = max(1, BLOCK_BYTES // item)  # the GEMV's column block, its accumulator in L1
    threads = min(numba.get_num_threads(), len(seeds))

    def args(bufs: int) -> tuple[object, ...]:
        # one block's buffer a thread: the only memory the pass allocates
        h = np.empty((bufs, block), dtype=dt)
        return (
            seeds,
            first_skip,
            block,
            dt.type(std),
            *tables,
            f32,
            mix,
            flat,
            rs,
            row,
            dt.type(c0),
            h,
            sub,
        )

    if threads > 1 and _parallel_lock.acquire(blocking=False):
        try:
            _parallel(*args(threads))
            return
        finally:
            _parallel_lock.release()
    _serial(*args(1))
