"""The precompute's per-tile recursion, compiled (numba), imported by
`cocoon_ckpt.embedding.precompute` on first use.

For every coordinate of a tile and every step t it does what `dp.noise.bandmf_step`
and the coalescing around it do, in the same order of rounding, each operation in the
noise's dtype and rounded on its own:

    h   = (...((m0 r0) + m1 r1) + ...) + m[S-1] r[S-1]   the fixed-order GEMV (dp.gemv)
    w   = (z - h) / c0                                    ring slot t mod S <- w
    w   = w * s_t                                         only where s_t != 1
    entry of a row read at t = float(-acc); acc = 0       before step t's term
    acc = acc + float64(w) * f_t                          float64, no fused multiply-add

numba compiles with `fastmath=False`: LLVM gets no `contract` flag, so a multiply and
an add are never fused into one FMA, and no sum is reassociated; tests/cocoon_ckpt/
test_precompute_kernel.py compares the CSC with the per-step `bandmf_step` loop bit for
bit.

Why a kernel and not the per-step numpy/torch calls: those made about ten passes over
the tile per step (GEMV, subtract, divide, ring write, cast, multiply, add, each a
separate call with its own temporary, the elementwise ones on torch's intra-op threads
that stall under load). Measured at the default DLRM bench size (b = 8, 664,064 cold
rows, load ~6): 82.8 s with torch on 2 threads, 28.9 s with two tiles at once; the
GEMV was a quarter and torch's elementwise steps over a third of it.

Loop shape: the tile's columns are cut into chunks of whole rows; each chunk runs
through all the steps of a step chunk while its ring slice (S x chunk) and accumulator
stay in L1/L2, so the ring is read from memory once per step chunk instead of once per
step. Within a chunk the innermost loops run over 1-D views from index 0 (LLVM
vectorizes those, as in dp._gemv_kernel).
"""

from __future__ import annotations

import numpy as np
from numba import njit

# The GEMV over a chunk's slots is the engine's own (each product and each addition
# rounded on its own, slots in order): one definition, so the tile pass cannot drift
# from `cocoon_ckpt.dp.gemv`'s fixed-order scheme.
from cocoon_ckpt.dp._gemv_kernel import _rows_into

__all__ = ["CHUNK_COLUMNS", "tile_steps"]

#: Columns per chunk: at b = 32 the chunk's ring (31 x 1024 float32) is 124 KiB, in L2.
CHUNK_COLUMNS = 1024


@njit(nogil=True, fastmath=False, cache=True)
def _recur(w, z, c0):  # type: ignore[no-untyped-def]
    # w holds h on entry: w = (z - h) / c0, two roundings in the dtype
    for j in range(w.shape[0]):
        w[j] = (z[j] - w[j]) / c0


@njit(nogil=True, fastmath=False, cache=True)
def _fresh_only(w, z, c0):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        w[j] = z[j] / c0


@njit(nogil=True, fastmath=False, cache=True)
def _store(dst, w):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        dst[j] = w[j]


@njit(nogil=True, fastmath=False, cache=True)
def _scale(w, s):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        w[j] = w[j] * s


@njit(nogil=True, fastmath=False, cache=True)
def _accumulate(acc, w, f):  # type: ignore[no-untyped-def]
    for j in range(w.shape[0]):
        acc[j] = acc[j] + np.float64(w[j]) * f


@njit(nogil=True, fastmath=False, cache=True)
def tile_steps(  # type: ignore[no-untyped-def]
    z, t0, ring, acc, mixes, c0, scales, factors, ev_ptr, ev_steps, nxt, out, dim, chunk_rows
):
    """Run steps t0 .. t0 + T - 1 of one tile's recursion and coalescing.

    Args:
        z: (T * W,) fresh noise of the step chunk, step-major (W = k * dim columns).
        t0: the chunk's first step.
        ring: (S * W,) the tile's ring, slot-major, carried between step chunks.
        acc: (W,) float64 pending sums, carried between step chunks.
        mixes: (n, S) mixing vectors in the dtype, S >= 0.
        c0: c_0 in the dtype.
        scales: (n,) s_t in the dtype.
        factors: (n,) float64 lr_t / B.
        ev_ptr: (k + 1,) int64; local row l's reads are ev_steps[ev_ptr[l]:ev_ptr[l+1]].
        ev_steps: (E,) int64, increasing per row.
        nxt: (k,) int64, each row's next read to close (index into ev_steps), carried.
        out: (E, dim) entry values in the dtype, written at the read's index.
        dim: columns per row.
        chunk_rows: rows per column chunk.
    """
    k = nxt.shape[0]
    width = k * dim
    steps = z.shape[0] // width if width else 0
    slots = mixes.shape[1]
    h = np.empty(chunk_rows * dim, dtype=ring.dtype)
    for r0 in range(0, k, chunk_rows):
        r1 = min(r0 + chunk_rows, k)
        lo, hi = r0 * dim, r1 * dim
        w = h[: hi - lo]
        for s in range(steps):
            t = t0 + s
            zt = z[s * width + lo : s * width + hi]
            if slots:
                _rows_into(w, mixes[t], ring, width, lo, hi)
                _recur(w, zt, c0)
                b = (t % slots) * width
                _store(ring[b + lo : b + hi], w)
            else:
                _fresh_only(w, zt, c0)
            if scales[t] != 1.0:
                _scale(w, scales[t])
            for r in range(r0, r1):
                p = nxt[r]
                if p < ev_ptr[r + 1] and ev_steps[p] == t:
                    for d in range(dim):
                        out[p, d] = -acc[r * dim + d]
                        acc[r * dim + d] = 0.0
                    nxt[r] = p + 1
            _accumulate(acc[lo:hi], w, factors[t])
