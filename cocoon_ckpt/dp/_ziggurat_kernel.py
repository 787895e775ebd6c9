"""The default scheme's Gaussians compiled (numba), imported by
`cocoon_ckpt.dp.default_noise` on first use: numpy's SFC64 and numpy's ziggurat
(`Generator.standard_normal`), the same operations in the same order, so the bits are
the scheme's (`numpy-sfc64-blake2b256-block65536/v2`), not a new scheme.

Why: a block's 65,536 Gaussians took ~480 us here in numpy, nearly all of it the
ziggurat (the keyed BLAKE2b seed ~1 us, the SeedSequence ~5 us, the generator object
~4 us: `bench/noise_step.py` prints the split). numpy reaches its bit generator through
a function pointer per draw and buffers SFC64's second 32-bit half in memory; here the
generator's four words stay in registers inside the loop. Blocks are independent, so
they are split over the cores (`prange`), each block drawn by one thread from its own
state: the thread count changes no bit.

What it reproduces, from numpy's C (`_sfc64.pyx`, `sfc64.h`, `distributions.c`):

- SFC64 seeded with three words s0..s2 from the block's SeedSequence, the counter at 1,
  and twelve outputs discarded (`sfc64_set_seed`).
- float64: each try takes one 64-bit output r: idx = r & 0xff, sign = bit 8,
  rabs = the next 52 bits; x = rabs * wi[idx], negated by sign; accepted when
  rabs < ki[idx]; idx 0 draws the tail from two `next_double`s and log1p; another idx
  is accepted when (fi[idx-1] - fi[idx]) u + fi[idx] < exp(-x^2 / 2), u one
  `next_double`, else the try is repeated.
- float32: the same on 32-bit outputs (idx = r & 0xff, sign = bit 8, rabs = 23 bits),
  each 64-bit output giving its low half first and its high half on the next 32-bit
  draw, in float arithmetic, exp in double, log1pf in the tail.

numba compiles with `fastmath=False`: LLVM gets no `contract` flag, so no multiply and
add is fused into an FMA and nothing is reassociated. tests/cocoon_ckpt/
test_ziggurat_kernel.py holds it to numpy's generator bit for bit, tails included.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from cocoon_ckpt.dp._gemv_kernel import _parallel_lock
from cocoon_ckpt.dp._ziggurat_tables import (
    FI_DOUBLE,
    FI_FLOAT,
    KI_DOUBLE,
    KI_FLOAT,
    NOR_INV_R,
    NOR_INV_R_F,
    NOR_R,
    NOR_R_F,
    WI_DOUBLE,
    WI_FLOAT,
)

__all__ = ["gaussians_into"]

_U1 = np.uint64(1)
_U3 = np.uint64(3)
_U8 = np.uint64(8)
_U9 = np.uint64(9)
_U11 = np.uint64(11)
_U24 = np.uint64(24)
_U32 = np.uint64(32)
_U40 = np.uint64(40)
_BYTE = np.uint64(0xFF)
_M52 = np.uint64(0x000FFFFFFFFFFFFF)
_M23 = np.uint64(0x7FFFFF)
_LOW32 = np.uint64(0xFFFFFFFF)
_TWO_M53 = 1.0 / 9007199254740992.0
_TWO_M24_F = np.float32(1.0 / 16777216.0)


@njit(nogil=True, fastmath=False, cache=True, inline="always")
def _sfc64(a, b, c, w):  # type: ignore[no-untyped-def]
    # numpy's sfc64_next: returns the output and the new state
    tmp = a + b + w
    return tmp, b ^ (b >> _U11), c + (c << _U3), ((c << _U24) | (c >> _U40)) + tmp, w + _U1


@njit(nogil=True, fastmath=False, cache=True)
def _seeded(seed):  # type: ignore[no-untyped-def]
    a, b, c, w = seed[0], seed[1], seed[2], _U1
    for _ in range(12):
        _, a, b, c, w = _sfc64(a, b, c, w)
    return a, b, c, w


@njit(nogil=True, fastmath=False, cache=True)
def _block_f64(seed, out, skip, std, wi, ki, fi):  # type: ignore[no-untyped-def]
    # out[i - skip] = std * (the block's i-th Gaussian), i from skip to skip + len(out)
    a, b, c, w = _seeded(seed)
    n = skip + out.shape[0]
    i = 0
    while i < n:
        r, a, b, c, w = _sfc64(a, b, c, w)
        idx = np.intp(r & _BYTE)
        r = r >> _U8
        rabs = (r >> _U1) & _M52
        x = np.float64(rabs) * wi[idx]
        if r & _U1:
            x = -x
        if rabs >= ki[idx]:
            if idx == 0:
                while True:
                    u, a, b, c, w = _sfc64(a, b, c, w)
                    xx = -NOR_INV_R * math.log1p(-(np.float64(u >> _U11) * _TWO_M53))
                    u, a, b, c, w = _sfc64(a, b, c, w)
                    yy = -math.log1p(-(np.float64(u >> _U11) * _TWO_M53))
                    if yy + yy > xx * xx:
                        break
                x = -(NOR_R + xx) if (rabs >> _U8) & _U1 else NOR_R + xx
            else:
                u, a, b, c, w = _sfc64(a, b, c, w)
                f = (fi[idx - 1] - fi[idx]) * (np.float64(u >> _U11) * _TWO_M53) + fi[idx]
                if not f < math.exp(-0.5 * x * x):
                    continue
        if i >= skip:
            out[i - skip] = x * std
        i += 1


@njit(nogil=True, fastmath=False, cache=True, inline="always")
def _next32(a, b, c, w, high, has_high):  # type: ignore[no-untyped-def]
    # numpy's sfc64_next32: an output's low half, and its high half on the next call
    if has_high:
        return high, a, b, c, w, high, False
    r, a, b, c, w = _sfc64(a, b, c, w)
    return r & _LOW32, a, b, c, w, r >> _U32, True


@njit(nogil=True, fastmath=False, cache=True)
def _block_f32(seed, out, skip, std, wi, ki, fi):  # type: ignore[no-untyped-def]
    # as _block_f64 on 32-bit draws, in float arithmetic (exp in double, as numpy's C)
    a, b, c, w = _seeded(seed)
    high, has_high = np.uint64(0), False
    n = skip + out.shape[0]
    i = 0
    while i < n:
        r, a, b, c, w, high, has_high = _next32(a, b, c, w, high, has_high)
        idx = np.intp(r & _BYTE)
        rabs = np.uint32((r >> _U9) & _M23)
        x = np.float32(rabs) * wi[idx]
        if (r >> _U8) & _U1:
            x = -x
        if rabs >= ki[idx]:
            if idx == 0:
                while True:
                    u, a, b, c, w, high, has_high = _next32(a, b, c, w, high, has_high)
                    lu = np.float32(math.log1p(-(np.float32(u >> _U8) * _TWO_M24_F)))
                    xx = -NOR_INV_R_F * lu
                    u, a, b, c, w, high, has_high = _next32(a, b, c, w, high, has_high)
                    yy = -np.float32(math.log1p(-(np.float32(u >> _U8) * _TWO_M24_F)))
                    if yy + yy > xx * xx:
                        break
                x = -(NOR_R_F + xx) if (rabs >> np.uint32(8)) & np.uint32(1) else NOR_R_F + xx
            else:
                u, a, b, c, w, high, has_high = _next32(a, b, c, w, high, has_high)
                f = (fi[idx - 1] - fi[idx]) * (np.float32(u >> _U8) * _TWO_M24_F) + fi[idx]
                xd = np.float64(x)
                if not np.float64(f) < math.exp(-0.5 * xd * xd):
                    continue
        if i >= skip:
            out[i - skip] = x * std
        i += 1


@njit(nogil=True, fastmath=False, cache=True)
def _block(seeds, j, out, first_skip, std, block, wi, ki, fi, f32):  # type: ignore[no-untyped-def]
    lo = j * block - first_skip
    a = max(lo, 0)
    z = min(lo + block, out.shape[0])
    if f32:
        _block_f32(seeds[j], out[a:z], a - lo, std, wi, ki, fi)
    else:
        _block_f64(seeds[j], out[a:z], a - lo, std, wi, ki, fi)


@njit(nogil=True, fastmath=False, parallel=True, cache=True)
def _parallel(seeds, out, first_skip, std, block, wi, ki, fi, f32):  # type: ignore[no-untyped-def]
    for j in prange(seeds.shape[0]):
        _block(seeds, j, out, first_skip, std, block, wi, ki, fi, f32)


@njit(nogil=True, fastmath=False, cache=True)
def _serial(seeds, out, first_skip, std, block, wi, ki, fi, f32):  # type: ignore[no-untyped-def]
    for j in range(seeds.shape[0]):
        _block(seeds, j, out, first_skip, std, block, wi, ki, fi, f32)


def gaussians_into(
    seeds: np.ndarray, out: np.ndarray, first_skip: int, std: float, block: int, threads: int
) -> None:
    """The scheme's Gaussians of consecutive blocks, cut to `out` and scaled by `std`.

    Block j's values are out[j * block - first_skip : (j + 1) * block - first_skip],
    clipped to out; values before out[0] and after out[-1] are drawn (the ziggurat emits
    them in order) and dropped.

    Args:
        seeds: (blocks, 3) uint64, each block's SFC64 seed words (its SeedSequence's
            `generate_state(3, np.uint64)`).
        out: (n,) C-contiguous float32 or float64, written.
        first_skip: values of the first block before out[0], 0 <= first_skip < block.
        std: multiplies each value in out's dtype (x * 1.0 is x: numpy skipping it is
            the same bits).
        block: values per block.
        threads: more than 1 splits the blocks over numba's threads (the same bits).
    """
    f32 = out.dtype == np.float32
    tables = (WI_FLOAT, KI_FLOAT, FI_FLOAT) if f32 else (WI_DOUBLE, KI_DOUBLE, FI_DOUBLE)
    args = (seeds, out, first_skip, out.dtype.type(std), block, *tables, f32)
    if threads > 1 and numba.get_num_threads() > 1 and len(seeds) > 1:
        if _parallel_lock.acquire(blocking=False):
            try:
                _parallel(*args)
                return
            finally:
                _parallel_lock.release()
    _serial(*args)
