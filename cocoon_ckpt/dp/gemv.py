"""The history GEMV, h = sum_i mix[i] * ring[i], in one fixed order of rounding.

BLAS computes the same sum in an order that depends on the thread count, the CPU's
kernel and where a column range starts: measured here, OpenBLAS sgemv over a column
shard differs in the last bits from the same columns of the whole, and a run with 2
threads differs from one with 1. A tiered or resumed history would then add noise that
is not bit-identical to an uninterrupted single-tier run.

This kernel defines the sum per coordinate as
    h = (...((mix[0] r[0]) + mix[1] r[1]) + ...) + mix[S-1] r[S-1]
with each product and each addition rounded on its own (IEEE, no fused multiply-add).
Elementwise multiply and add are correctly rounded everywhere, so the result is a pure
function of the inputs: the same for any column split, thread count, tier (numpy,
torch on CPU or CUDA, the far worker) and machine.

`mix_history` runs the compiled kernel (`cocoon_ckpt.dp._gemv_kernel`, numba: one pass
over the ring on all cores, at the read-stream limit); `mix_history_reference` is the
same sum in numpy, kept as the definition that tests compare the compiled kernel with,
bit for bit. numba is a hard dependency, so which kernel runs never depends on what is
installed. The cost is measured in bench/noise_step.py.

Import-light (numpy only; numba on the first `mix_history`, torch only inside
`mix_history_torch`): the far-memory worker process imports this module and nothing
else of the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["GEMV_SCHEME", "mix_history", "mix_history_reference", "mix_history_torch"]

#: Recorded with the generator backend: a store written under another scheme resumes
#: only when the caller accepts different noise.
GEMV_SCHEME = "fixed-order-mul-add/v1"

#: Columns per block: accumulator and temporary (2 x 256 KiB in float32) stay in L2.
BLOCK_COLS = 1 << 16


#: dtypes the compiled kernel is built for; others take the numpy reference (same bits).
_COMPILED = (np.dtype(np.float32), np.dtype(np.float64))

#: Ring elements below which `mix_history` runs the numpy reference (same bits). A
#: process's first compiled call costs about 1 s here (numba's import and runtime
#: start-up, with the kernel loaded from its on-disk cache); a GEMV this small takes
#: under 0.5 ms in numpy, so a short job or a test's subprocess would never earn it back.
COMPILED_MIN_ELEMENTS = 1 << 20


def mix_history(
    mix: np.ndarray,
    ring: np.ndarray,
    out: np.ndarray | None = None,
    *,
    compiled: bool | None = None,
) -> np.ndarray:
    """h = sum_i mix[i] * ring[i] in the fixed order (module docstring), compiled.

    Bit-identical to `mix_history_reference` for any shape, column slice, thread count
    (`numba.set_num_threads`) and caller thread.

    Args:
        mix: (S,) mixing vector; cast to ring's dtype first.
        ring: (S, W) history, float32 or float64 (a memory map or a column slice of a
            wider ring works without a copy).
        out: (W,) destination, or None for a new array.
        compiled: True: the compiled kernel; False: the numpy reference; None: compiled
            from `COMPILED_MIN_ELEMENTS` ring elements on. The result is the same.

    Returns:
        (W,) array in ring's dtype.
    """
    slots, width = ring.shape
    if out is None:
        out = np.empty(width, dtype=ring.dtype)
    if compiled is None:
        compiled = slots * width >= COMPILED_MIN_ELEMENTS
    if not compiled or ring.dtype not in _COMPILED:
        return mix_history_reference(mix, ring, out)
    if slots == 0:
        out[...] = 0
        return out
    m = np.array(mix, dtype=ring.dtype)  # a private, writable, contiguous copy
    if m.shape != (slots,):
        raise ValueError(f"mixing vector has shape {m.shape}, the ring {slots} slots")
    from cocoon_ckpt.dp._gemv_kernel import mix_into

    item = ring.dtype.itemsize
    if not (ring.strides[1] == item and ring.strides[0] >= 0 and ring.strides[0] % item == 0):
        ring = np.ascontiguousarray(ring)
    direct = out.dtype == ring.dtype and out.flags.c_contiguous and out.flags.writeable
    dst = out.view(np.ndarray) if direct else np.empty(width, dtype=ring.dtype)
    mix_into(m, ring, dst)
    if not direct:
        out[...] = dst
    return out


def mix_history_reference(
    mix: np.ndarray, ring: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """h = sum_i mix[i] * ring[i] in the fixed order, in numpy: the definition.

    Args:
        mix: (S,) mixing vector; cast to ring's dtype first.
        ring: (S, W) history, float32 or float64 (a memory map works).
        out: (W,) destination, or None for a new array.

    Returns:
        (W,) array in ring's dtype.
    """
    slots, width = ring.shape
    if out is None:
        out = np.empty(width, dtype=ring.dtype)
    if slots == 0:
        out[...] = 0
        return out
    m = np.asarray(mix, dtype=ring.dtype)
    if m.shape != (slots,):
        raise ValueError(f"mixing vector has shape {m.shape}, the ring {slots} slots")
    tmp = np.empty(min(width, BLOCK_COLS), dtype=ring.dtype)
    for lo in range(0, width, BLOCK_COLS):
        hi = min(lo + BLOCK_COLS, width)
        acc, t = out[lo:hi], tmp[: hi - lo]
        np.multiply(ring[0, lo:hi], m[0], out=acc)
        for i in range(1, slots):
            np.multiply(ring[i, lo:hi], m[i], out=t)
            np.add(acc, t, out=acc)
    return out


def mix_history_torch(
    mix: np.ndarray, ring: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The same sum on a torch tensor (CPU or CUDA), bit-identical to `mix_history`.

    Separate `mul` and `add_` kernels, never `addcmul`/`add(alpha=)`, which may fuse the
    multiply and add into one rounding. The scalars are passed as the exact values of
    the ring's dtype.
    """
    import torch

    slots, width = ring.shape
    if out is None:
        out = torch.empty(width, dtype=ring.dtype, device=ring.device)
    if slots == 0:
        out.zero_()
        return out
    np_dtype: Any = np.float64 if ring.dtype == torch.float64 else np.float32
    m = [float(v) for v in np.asarray(mix, dtype=np_dtype)]
    if len(m) != slots:
        raise ValueError(f"mixing vector has {len(m)} entries, the ring {slots} slots")
    # On a GPU one launch per row is cheaper than blocks; the result is the same.
    block = width if ring.is_cuda else BLOCK_COLS
    tmp = torch.empty(min(width, block), dtype=ring.dtype, device=ring.device)
    for lo in range(0, width, block):
        hi = min(lo + block, width)
        acc, t = out[lo:hi], tmp[: hi - lo]
        torch.mul(ring[0, lo:hi], m[0], out=acc)
        for i in range(1, slots):
            torch.mul(ring[i, lo:hi], m[i], out=t)
            acc.add_(t)
    return out
