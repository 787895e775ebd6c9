"""The compiled kernels a DP step calls, loaded off the training thread before its first
noise step.

A process's first call of a numba kernel starts numba and loads the kernel from its
on-disk cache: on this VM the first step of an 8M-parameter job spent 1.5 s drawing its
fresh noise and 1.0 s in its ring GEMV, against 0.08 s each in later steps (load 10,
`bench/stall.py`). `warm_kernels` makes those first calls on small scratch arrays in a
daemon thread when a trainer is built, so they overlap what comes before the noise (the
caller's set-up, the first step's clipped sum). Nothing they compute is kept or read:
no result of the job depends on whether or when the warm-up ran. The kernels take a
lock around their parallel launch, so a warm-up beside the trainer's own call is safe.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from cocoon_ckpt.dp.default_noise import BLOCK, keyed_gaussians
from cocoon_ckpt.dp.gemv import mix_history

__all__ = ["warm_kernels"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started: set[tuple[str, bool, int]] = set()


def warm_kernels(dtype: str, *, ziggurat: bool, threads: int) -> threading.Thread | None:
    """Start loading the GEMV kernel (and, if `ziggurat`, the default generator's) for
    `dtype` in a daemon thread, once per process; the thread, or None if started before.

    Args:
        dtype: the noise's dtype, "float32" or "float64".
        ziggurat: the job draws its fresh noise with the default generator.
        threads: the thread count its draws run at (above 1 the parallel kernels too).
    """
    key = (np.dtype(dtype).name, ziggurat, threads)
    with _lock:
        if key in _started:
            return None
        _started.add(key)
    t = threading.Thread(
        target=_warm, args=(np.dtype(dtype), ziggurat, threads), name="warm-kernels", daemon=True
    )
    t.start()
    return t


def _warm(dt: np.dtype[np.floating], ziggurat: bool, threads: int) -> None:
    try:
        mix_history(np.ones(2, dtype=dt), np.zeros((2, 64), dtype=dt), compiled=True)
        if ziggurat:
            # two blocks: above one thread the draws take the parallel kernel
            out = np.empty(2 * BLOCK, dtype=dt)
            keyed_gaussians(bytes(32), 0, 0, 2 * BLOCK, out, 1.0, threads, compiled=True)
    except Exception as exc:  # a failed warm-up only leaves the first step its load
        log.debug("warming the compiled kernels failed: %s", exc)
