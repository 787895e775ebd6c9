"""The DP step's two elementwise passes over all m coordinates, each in one pass:
w_t = (z_t - h_t) / c_0 in z's buffer, and the noisy gradient (sum + w_t) / B.

torch runs each as two kernels (a subtraction, then a division), so each pass reads and
writes the (m,) vectors twice: at 85.9M parameters 0.09 s of a 2.0 s step apiece. Here
each is one compiled loop (numba, `fastmath=False`: no fused multiply-add, no
reassociation), with the same IEEE operations in the same order and the intermediate
rounded to the dtype, so the bits are torch's: the scalar is cast to the vectors' dtype
first, as torch casts a Python scalar to a float tensor's dtype. Below
`gemv.COMPILED_MIN_ELEMENTS` elements, off the CPU, or in mixed dtypes the torch
kernels run instead (the same bits; tests/cocoon_ckpt/test_step_buffers.py compares
both).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS

__all__ = ["add_div_into", "sub_div_"]


@njit(nogil=True, fastmath=False, cache=True)
def _sub_div(z, h, c):  # type: ignore[no-untyped-def]
    for j in range(z.shape[0]):
        z[j] = (z[j] - h[j]) / c


@njit(nogil=True, fastmath=False, cache=True)
def _add_div(out, a, b, d):  # type: ignore[no-untyped-def]
    for j in range(out.shape[0]):
        out[j] = (a[j] + b[j]) / d


# out is a: LLVM's vectorized loop checks that out overlaps neither input and falls back
# to the scalar loop when it does (0.107 s against torch's 0.090 at 85.9M); written as
# an update of one array it vectorizes (0.05 s)
@njit(nogil=True, fastmath=False, cache=True)
def _add_div_(a, b, d):  # type: ignore[no-untyped-def]
    for j in range(a.shape[0]):
        a[j] = (a[j] + b[j]) / d


def _compiled(*tensors: torch.Tensor, compiled: bool | None = None) -> bool:
    first = tensors[0]
    return (
        (first.numel() >= COMPILED_MIN_ELEMENTS if compiled is None else compiled)
        and first.dtype in (torch.float32, torch.float64)
        and all(
            t.device.type == "cpu"
            and t.dtype == first.dtype
            and t.is_contiguous()
            and t.shape == first.shape
            and t.dim() == 1
            for t in tensors
        )
    )


def sub_div_(
    z: torch.Tensor, h: np.ndarray, c0: float, *, compiled: bool | None = None
) -> torch.Tensor:
    """z <- (z - h) / c0 in z's dtype, in place; returns z.

    Args:
        z: (m,) float32 or float64 (the step's own buffer, or a chunk of a ring slot).
        h: (m,) host array (the GEMV's result), z's dtype.
        c0: the divisor, cast to z's dtype first.
        compiled: True: the compiled loop (where the dtypes and layout allow); False:
            torch's two kernels; None: compiled from `COMPILED_MIN_ELEMENTS` elements on
            (a step in a ring slot decides once for all its chunks). The same bits.
    """
    ht = torch.from_numpy(h)
    if _compiled(z, ht, compiled=compiled):
        _sub_div(z.numpy(), h, z.numpy().dtype.type(c0))
        return z
    return torch.sub(z, ht, out=z).div_(c0)


def add_div_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, d: float) -> torch.Tensor:
    """out <- (a + b) / d, elementwise in out's dtype (out may be a); returns out.

    Args:
        out, a, b: (m,) tensors of one dtype on one device.
        d: the divisor, cast to their dtype first.
    """
    if _compiled(out, a, b):
        o = out.numpy()
        if out.data_ptr() == a.data_ptr():
            _add_div_(o, b.numpy(), o.dtype.type(d))
        else:
            _add_div(o, a.numpy(), b.numpy(), o.dtype.type(d))
        return out
    torch.add(a, b, out=out)
    return out.div_(d)
