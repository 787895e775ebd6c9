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

torch's thread count belongs to the calling thread (OpenMP), so other threads of the
process keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_thread"]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block, the caller's count restored after."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
