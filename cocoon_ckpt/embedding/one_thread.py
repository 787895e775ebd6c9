"""Run the embedding path's small scatter and gather ops on the calling thread alone.

An embedding step's own tensor ops are small (a batch of rows: (B, dim) gathers, unique
and scatter-adds of the read rows, a CSC column): torch still opens an intra-op
parallel region for each, and with other processes on the cores one of its threads is
often not scheduled, so every region waits for it at the barrier. Measured on this
2-core machine at load ~11 ((1024, 16) rows into a 200,000-row table): `index_add_`
5.3-5.6 ms on torch's 2 threads against 0.11 ms on one (0.13 ms with the switch back
and forth). The results are the same bits: these kernels give each output row to one
thread, in index order, whatever the thread count (tests/cocoon_ckpt/
test_one_thread.py compares them).

torch's thread count belongs to the calling thread (OpenMP): a thread that has used
torch keeps its own, but one whose first torch call comes while another thread's count
is switched starts with the switched count and keeps it (seen with torch 2.13's CPU
build), so a long-lived worker should set its own count. `fixed_threads(n)` is the same switch at any count: the trainer
takes its gradients under a job's recorded count (`train.grad_threads`), because GEMMs
are not thread-count invariant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["fixed_threads", "one_thread"]


@contextmanager
def fixed_threads(n: int) -> Iterator[None]:
    """torch on `n` intra-op threads inside the block, the caller's count restored after
    (nothing is switched when the count already is `n`, so that path costs nothing).

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"fixed_threads(n={n}): a thread count must be >= 1")
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block, the caller's count restored after."""
    with fixed_threads(1):
        yield
