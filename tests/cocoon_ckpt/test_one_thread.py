"""The embedding path's small ops give the same bits on one torch thread as on several
(`cocoon_ckpt.embedding.one_thread` runs them on one), and the caller's count returns."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt.embedding.one_thread import one_thread
from cocoon_ckpt.embedding.sparse import sum_rows


def _ops(ids: torch.Tensor, g: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> list[bytes]:
    uniq, out = sum_rows(ids, g, s)
    w = w.clone()
    w.index_add_(0, uniq, out, alpha=-0.037)
    w.index_add_(0, ids, g)
    return [x.numpy().tobytes() for x in (uniq, out, w, w[ids])]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 5000),
    rows=st.integers(1, 3000),
    dim=st.sampled_from([1, 16, 64]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_small_ops_are_the_same_bits_on_one_thread(
    n: int, rows: int, dim: int, dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=gen)
    g = torch.randn(n, dim, generator=gen, dtype=dtype)
    s = torch.rand(n, generator=gen, dtype=dtype)
    w = torch.randn(rows, dim, generator=gen, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, before))
        many = _ops(ids, g, s, w)
        with one_thread():
            assert torch.get_num_threads() == 1
            one = _ops(ids, g, s, w)
        assert torch.get_num_threads() == max(2, before)
    finally:
        torch.set_num_threads(before)
    assert one == many
