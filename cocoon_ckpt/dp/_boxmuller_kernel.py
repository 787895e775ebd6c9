"""The compiled Box-Muller of the secure generator (numba), imported by
`cocoon_ckpt.dp.secure_noise` on first use.

The same operations in the same order as `secure_noise.box_muller_reference`, one pair
at a time, so the bits are the same: the numpy version makes ~90 passes over
temporaries and runs at 10-15 M samples/s here, this one keeps a pair in registers.
numba compiles with `fastmath=False`, so LLVM gets no `contract` flag and never fuses a
multiply and an add into an FMA (which would change the roundings the scheme fixes);
tests/cocoon_ckpt/test_secure_noise.py compares it with the numpy reference bit for
bit. Pairs are independent, so splitting them over threads (`prange`) changes no bit.
The coefficient arrays are passed in, not closed over, so both versions use the
one definition in `secure_noise`.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from cocoon_ckpt.dp._gemv_kernel import _parallel_lock

__all__ = ["box_muller_into", "box_muller_kernel"]

#: Pairs per parallel task (64 KiB of words): large enough to amortise the launch.
PAIRS_PER_TASK = 4096


@njit(nogil=True, fastmath=False, cache=True)
def box_muller_into(words, out, sin_c, cos_c, atanh_c, consts):  # type: ignore[no-untyped-def]
    """out[2i], out[2i+1] from words[2i], words[2i+1]; see secure_noise's scheme.

    Args:
        words: (n,) uint64, n even.
        out: (n,) float64, written.
        sin_c, cos_c, atanh_c: (k,) float64 series coefficients, lowest first.
        consts: (4,) float64: ln2 hi, ln2 lo, sqrt(1/2), 2^-53.
    """
    ln2_hi, ln2_lo, sqrt_half, two_m53 = consts[0], consts[1], consts[2], consts[3]
    octant = np.uint64(1 << 50)
    quad = np.uint64(1 << 51)
    qmask = np.uint64((1 << 51) - 1)
    one = np.uint64(1)
    sh = np.uint64(11)
    for i in range(words.shape[0] // 2):
        # radius: sqrt(-2 ln u), u = (a + 1) 2^-53
        u = np.float64((words[2 * i] >> sh) + one) * two_m53
        m, e = math.frexp(u)
        if m < sqrt_half:
            m = m * 2.0
            e = e - 1
        ef = np.float64(e)
        f = m - 1.0
        s = f / (2.0 + f)
        y = s * s
        acc = atanh_c[atanh_c.shape[0] - 1]
        for j in range(atanh_c.shape[0] - 2, -1, -1):
            acc = acc * y
            acc = acc + atanh_c[j]
        ln_m = s * acc
        radius = math.sqrt(-2.0 * (ef * ln2_hi + (ef * ln2_lo + ln_m)))
        # angle: v = c 2^-53, folded to [0, 1/8] turn by integer operations
        c = words[2 * i + 1] >> sh
        quadrant = c >> np.uint64(51)
        r = c & qmask
        fold = r > octant
        if fold:
            r = quad - r
        x = np.float64(r) * two_m53
        y = x * x
        acc = sin_c[sin_c.shape[0] - 1]
        for j in range(sin_c.shape[0] - 2, -1, -1):
            acc = acc * y
            acc = acc + sin_c[j]
        sn = x * acc
        acc = cos_c[cos_c.shape[0] - 1]
        for j in range(cos_c.shape[0] - 2, -1, -1):
            acc = acc * y
            acc = acc + cos_c[j]
        cs = acc
        if fold:
            cs, sn = sn, cs
        if quadrant & one:
            cs, sn = -sn, cs
        if quadrant >= np.uint64(2):
            cs, sn = -cs, -sn
        out[2 * i] = radius * cs
        out[2 * i + 1] = radius * sn


@njit(nogil=True, fastmath=False, parallel=True, cache=True)
def _parallel(words, out, sin_c, cos_c, atanh_c, consts, pairs_per_task):  # type: ignore[no-untyped-def]
    pairs = words.shape[0] // 2
    for k in prange((pairs + pairs_per_task - 1) // pairs_per_task):
        lo = 2 * k * pairs_per_task
        hi = min(lo + 2 * pairs_per_task, 2 * pairs)
        box_muller_into(words[lo:hi], out[lo:hi], sin_c, cos_c, atanh_c, consts)


def box_muller_kernel(
    words: np.ndarray,
    out: np.ndarray,
    coefs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """`box_muller_into` over all cores when they are free, else on this thread.

    The gemv kernel's lock: numba's workqueue threading layer aborts on concurrent
    parallel launches, so a caller that finds another launch running (a tier's pool
    thread) runs the serial loop, which computes the same bits.
    """
    if numba.get_num_threads() > 1 and len(words) > 2 * PAIRS_PER_TASK:
        if _parallel_lock.acquire(blocking=False):
            try:
                _parallel(words, out, *coefs, PAIRS_PER_TASK)
                return
            finally:
                _parallel_lock.release()
    box_muller_into(words, out, *coefs)
