"""The compiled fixed-order GEMV (numba), imported by `cocoon_ckpt.dp.gemv` on first use.

Same order of rounding as `gemv.mix_history_reference`: per coordinate,
    h = (...((m0 r0 + m1 r1) + m2 r2) + ...) + m[S-1] r[S-1]
each product and each addition rounded on its own. numba compiles with
`fastmath=False`, so LLVM gets no `contract` flag and never fuses a multiply and an add
into one FMA, nor reassociates the sum; tests/cocoon_ckpt/test_gemv.py compares the
result with the numpy reference bit for bit, and checks the machine code for FMA.

Why numba and not a C extension: it installs from wheels with one pip command on a
fresh machine (no compiler, no build step in the package), and on this 2-core machine
it reads the ring at 0.9-1.0x of a numpy/torch sum over the same bytes (bench/
noise_step.py), where the numpy kernel (one temporary per row) reached 0.3x.

Loop shape, and why: the columns are cut into blocks of BLOCK_BYTES; each block's
accumulator (32 KiB) stays in L1 while the ring rows stream past it four at a time, so
the ring is read once and the accumulator is loaded and stored once per four rows.
Blocks are split over the threads (`prange`), each column computed by one thread in the
fixed order, so the thread count cannot change a bit. The innermost loops run over 1-D
views from index 0: LLVM vectorizes those (it does not vectorize the same loop written
with 2-D indices offset by the block start).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

__all__ = ["BLOCK_BYTES", "mix_into"]

#: Bytes of accumulator per block: 8192 float32 / 4096 float64 columns, L1-resident.
#: Measured on this machine (dim 4M, b = 8..64): blocks of 8-64 KiB are within the
#: run-to-run noise of each other.
BLOCK_BYTES = 32 * 1024


@njit(nogil=True, fastmath=False, cache=True)
def _first(o, r0, a0):  # type: ignore[no-untyped-def]
    for j in range(o.shape[0]):
        o[j] = a0 * r0[j]


@njit(nogil=True, fastmath=False, cache=True)
def _add1(o, r0, a0):  # type: ignore[no-untyped-def]
    for j in range(o.shape[0]):
        o[j] = o[j] + a0 * r0[j]


@njit(nogil=True, fastmath=False, cache=True)
def _add2(o, r0, r1, a0, a1):  # type: ignore[no-untyped-def]
    for j in range(o.shape[0]):
        o[j] = (o[j] + a0 * r0[j]) + a1 * r1[j]


@njit(nogil=True, fastmath=False, cache=True)
def _add4(o, r0, r1, r2, r3, a0, a1, a2, a3):  # type: ignore[no-untyped-def]
    for j in range(o.shape[0]):
        o[j] = (((o[j] + a0 * r0[j]) + a1 * r1[j]) + a2 * r2[j]) + a3 * r3[j]


@njit(nogil=True, fastmath=False, cache=True)
def _rows_into(o, mix, flat, rs, lo, hi):  # type: ignore[no-untyped-def]
    # o = sum_i mix[i] * flat[i * rs + lo : i * rs + hi], slots in order, four rows at a
    # time. The embedding precompute's tile pass calls it with its own chunk buffer.
    slots = mix.shape[0]
    _first(o, flat[lo:hi], mix[0])
    i = 1
    while i + 4 <= slots:
        b = i * rs
        _add4(
            o,
            flat[b + lo : b + hi],
            flat[b + rs + lo : b + rs + hi],
            flat[b + 2 * rs + lo : b + 2 * rs + hi],
            flat[b + 3 * rs + lo : b + 3 * rs + hi],
            mix[i],
            mix[i + 1],
            mix[i + 2],
            mix[i + 3],
        )
        i += 4
    if i + 2 <= slots:
        b = i * rs
        _add2(o, flat[b + lo : b + hi], flat[b + rs + lo : b + rs + hi], mix[i], mix[i + 1])
        i += 2
    if i < slots:
        b = i * rs
        _add1(o, flat[b + lo : b + hi], mix[i])


@njit(nogil=True, fastmath=False, cache=True)
def _block(mix, flat, rs, out, lo, hi):  # type: ignore[no-untyped-def]
    # Row i of the ring is flat[i * rs : i * rs + width]; this block is columns lo:hi.
    _rows_into(out[lo:hi], mix, flat, rs, lo, hi)


@njit(nogil=True, fastmath=False, parallel=True, cache=True)
def _mix_parallel(mix, flat, rs, out, block):  # type: ignore[no-untyped-def]
    width = out.shape[0]
    for k in prange((width + block - 1) // block):
        lo = k * block
        _block(mix, flat, rs, out, lo, min(lo + block, width))


@njit(nogil=True, fastmath=False, cache=True)
def _mix_serial(mix, flat, rs, out, block):  # type: ignore[no-untyped-def]
    width = out.shape[0]
    for k in range((width + block - 1) // block):
        lo = k * block
        _block(mix, flat, rs, out, lo, min(lo + block, width))


# One parallel launch at a time in this process: numba's workqueue threading layer
# aborts on concurrent launches, and two launches would only split the same cores. A
# caller that finds it busy (a tier's pool thread beside the trainer's) runs the serial
# kernel instead, which computes the same bits (each column in the same order).
_parallel_lock = threading.Lock()


def mix_into(mix: np.ndarray, ring: np.ndarray, out: np.ndarray) -> None:
    """out = sum_i mix[i] * ring[i] in the fixed order; `gemv.mix_history` checks and
    lays out the arguments.

    Args:
        mix: (S,) C-contiguous, writable, ring's dtype (float32 or float64), S >= 1.
        ring: (S, W) with contiguous rows (row stride any multiple of the item size).
        out: (W,) C-contiguous, writable, ring's dtype.
    """
    slots, width = ring.shape
    if width == 0:
        return
    item = ring.dtype.itemsize
    rs = ring.strides[0] // item if slots > 1 else width
    # One 1-D read-only view from ring[0, 0] to ring[S-1, W-1]: a column slice of a
    # wider ring (a tier's shard) then needs no copy and no second compiled layout.
    flat = np.lib.stride_tricks.as_strided(
        ring.view(np.ndarray), shape=((slots - 1) * rs + width,), strides=(item,), writeable=False
    )
    block = max(1, BLOCK_BYTES // item)
    if numba.get_num_threads() > 1 and _parallel_lock.acquire(blocking=False):
        try:
            _mix_parallel(mix, flat, rs, out, block)
        finally:
            _parallel_lock.release()
    else:
        _mix_serial(mix, flat, rs, out, block)
