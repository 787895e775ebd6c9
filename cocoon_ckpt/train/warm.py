"""The compiled kernels a DP step calls, loaded off the training thread before its first
noise step.

A process's first call of a numba kernel starts numba and loads the kernel from its
on-disk cache: on this VM the first step of an 8M-parameter job spent 1.5 s drawing its
fresh noise and 1.0 s in its ring GEMV, against 0.08 s each in later steps (load 10,
`bench/stall.py`). `warm_kernels` makes those first calls on small scratch arrays in a
daemon thread when a trainer is built, so they overlap the build's long C work (the
ring's first touch, which leaves the GIL free); the build waits for what is left before
it returns: an import and a kernel load hold the GIL, and a first step beside them
waited for it at each of its many short ops (a 25.8M transformer's first clipped sum
2.0-2.1 s against 0.45 s with the warm-up done first).
Nothing they compute is kept or read: no result of the job depends on whether or when
the warm-up ran. The kernels take a lock around their parallel launch, so a warm-up
beside another trainer's call is safe.

The same thread imports what torch.func's first vmap imports (sympy, through torch's
symbolic shapes): 0.75-1.2 s of a job's first clipped sum here.

`fault_in` does the same for the large buffers a step keeps from step to step (the
flat gradient buffer, `train.noisy_grads`): on this VM the first write of a page the
process never touched costs far more than the write (a 344 MB buffer took 5.9 s to
populate once and 0.07 s a moment later), and the first step of a 25.8M-parameter job
paid it for every buffer it keeps. The pages are populated by `madvise(MADV_POPULATE_
WRITE)`, which maps them writable without writing a byte, so it may run beside the
step that writes the buffer: whichever comes first faults a page in, and no value
depends on which.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import mmap
import sys
import threading
from collections.abc import Sequence

import numpy as np
import torch

from cocoon_ckpt.dp.default_noise import BLOCK, block_seeds, keyed_gaussians
from cocoon_ckpt.dp.elementwise import add_div_into, sub_div_
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS, mix_history

__all__ = ["fault_in", "warm_kernels"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: dict[tuple[str, bool, int], threading.Thread] = {}


def warm_kernels(dtype: str, *, ziggurat: bool, threads: int) -> threading.Thread:
    """Start loading the GEMV kernel (and, if `ziggurat`, the default generator's) for
    `dtype` in a daemon thread, once per process; the thread (the one started before, if
    any, so every trainer of the process can wait for it).

    Args:
        dtype: the noise's dtype, "float32" or "float64".
        ziggurat: the job draws its fresh noise with the default generator.
        threads: the thread count its draws run at (above 1 the parallel kernels too).
    """
    key = (np.dtype(dtype).name, ziggurat, threads)
    with _lock:
        if key in _started:
            return _started[key]
        t = threading.Thread(
            target=_warm,
            args=(np.dtype(dtype), ziggurat, threads),
            name="warm-kernels",
            daemon=True,
        )
        _started[key] = t
        t.start()
    return t


#: What torch.func's first vmap imports (sympy among it): 0.75-1.2 s here, paid by a
#: job's first clipped sum (ghost's per-sample losses, or vmap's gradients) otherwise
FIRST_VMAP_IMPORTS = "torch.fx.experimental.symbolic_shapes"


def _warm(dt: np.dtype[np.floating], ziggurat: bool, threads: int) -> None:
    try:
        # first: the clipped sum comes before the noise step (an import computes nothing
        # of the job's; a training thread importing it meanwhile waits for this one)
        importlib.import_module(FIRST_VMAP_IMPORTS)
        mix_history(np.ones(2, dtype=dt), np.zeros((2, 64), dtype=dt), compiled=True)
        # the step's elementwise passes (w_t = (z - h) / c_0, (sum + w) / B, in place and
        # not): compiled from COMPILED_MIN_ELEMENTS on; 0.25 s of a 25.8M job's first
        # step was loading the second
        a, b = (torch.from_numpy(np.ones(COMPILED_MIN_ELEMENTS, dtype=dt)) for _ in "ab")
        sub_div_(a, b.numpy(), 1.0)
        add_div_into(a, a, b, 1.0)
        add_div_into(b, a, a, 1.0)
        if ziggurat:
            # two blocks: above one thread the draws take the parallel kernel
            out = np.empty(2 * BLOCK, dtype=dt)
            keyed_gaussians(bytes(32), 0, 0, 2 * BLOCK, out, 1.0, threads, compiled=True)
            # the fused step in the ring slot (a ring that is one host array, from
            # COMPILED_MIN_ELEMENTS on; two blocks: the parallel kernel). Its first call
            # alone took 0.35-0.37 s against 8 ms after (numba's threading layer started
            # with it); after the kernels above, a 25.8M first step's noise and rest
            # took 68-69 ms against 60-61 steady without this, 59-63 / 59-63 with it
            from cocoon_ckpt.dp._slot_kernel import step_into_slot

            ring = np.zeros((2, 2 * BLOCK), dtype=dt)
            seeds = block_seeds(bytes(32), 0, 0, 2 * BLOCK)
            step_into_slot(np.ones(2, dtype=dt), ring, 0, seeds, 0, 1.0, 1.0, BLOCK)
    except Exception as exc:  # a failed warm-up only leaves the first step its load
        log.debug("warming the compiled kernels failed: %s", exc)


#: Linux's MADV_POPULATE_WRITE (5.14): fault pages in writable, changing no byte
_POPULATE_WRITE = 23
#: buffers below this are not worth a thread
FAULT_IN_BYTES = 1 << 20
#: pages faulted in by one call (a multiple of the page size)
FAULT_IN_PIECE = 4 << 20


def fault_in(buffers: Sequence[torch.Tensor]) -> threading.Thread | None:
    """Fault in the pages of `buffers` in a daemon thread; the thread, or None when there
    is nothing to do (no buffer of `FAULT_IN_BYTES` on the CPU, or not Linux).

    No byte of a buffer is written (`MADV_POPULATE_WRITE`): a caller may write the
    buffers while this runs, and nothing it reads depends on whether or when this ran.
    The thread holds the buffers until it is done, so their memory is never given back
    under it. A kernel without the advice (before Linux 5.14) leaves the pages to the
    first write, as before.

    Args:
        buffers: contiguous tensors; those on another device or too small are skipped.
    """
    todo = [
        b
        for b in buffers
        if b.device.type == "cpu" and b.is_contiguous() and b.nbytes >= FAULT_IN_BYTES
    ]
    if not todo or not sys.platform.startswith("linux"):
        return None
    t = threading.Thread(target=_populate, args=(todo,), name="fault-in", daemon=True)
    t.start()
    return t


def _populate(buffers: list[torch.Tensor]) -> None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise  # releases the GIL
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        for b in buffers:
            # the advice takes whole pages: from the one holding the first byte (mapped,
            # and left as it is: no byte is written)
            lo = b.data_ptr() - b.data_ptr() % mmap.PAGESIZE
            end = b.data_ptr() + b.nbytes
            # in pieces: each call holds the process's memory map lock, which the
            # training thread's own allocations (mmap, munmap) would wait on
            for at in range(lo, end, FAULT_IN_PIECE):
                if madvise(at, min(FAULT_IN_PIECE, end - at), _POPULATE_WRITE) != 0:
                    log.debug("faulting in a kept buffer failed: errno %d", ctypes.get_errno())
                    return
    except (OSError, AttributeError) as exc:  # no libc madvise: the first write faults
        log.debug("faulting in the kept buffers failed: %s", exc)
