"""`gather_rows` (one column gather and one zeroing per id tensor, not per table) gives
what indexing each table on its own gives, and leaves the caller's tensors alone; a table
whose per-sample row gradients would be wrong (padding_idx) is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.embedding.sparse import check_tables, gather_rows
from cocoon_ckpt.errors import UnsupportedModelError


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 500),
    cols=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3)), min_size=1, max_size=6),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**16),
)
def test_gather_rows_is_per_table_indexing(
    n: int, cols: list[tuple[int, int]], id_dtype: torch.dtype, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    specs = [TableSpec(param=f"t{k}", data_index=d, column=c) for k, (d, c) in enumerate(cols)]
    rows = [int(torch.randint(1, 300, (1,), generator=gen)) for _ in specs]
    weights = [torch.randn(r, 4, generator=gen) for r in rows]
    x = torch.randn(n, 3, generator=gen)
    batch = [torch.randint(0, 1 << 30, (n, 4), generator=gen).to(id_dtype) for _ in range(2)]
    for spec, r in zip(specs, rows, strict=True):  # every table's ids in its range
        batch[spec.data_index][:, spec.column] %= r
    batch = [*batch, x]
    original = [t.clone() for t in batch]
    chunk = list(batch)
    ids, got = gather_rows(weights, specs, chunk)
    for k, spec in enumerate(specs):
        want_ids = original[spec.data_index][:, spec.column].to(torch.int64)
        assert ids[k].dtype == torch.int64 and torch.equal(ids[k], want_ids)
        assert got[k].numpy().tobytes() == weights[k][want_ids].numpy().tobytes()
    for d in range(3):
        assert torch.equal(batch[d], original[d])  # the caller's tensors are not written
        want = original[d].clone()
        for spec in specs:
            if spec.data_index == d:
                want[:, spec.column] = 0
        assert torch.equal(chunk[d], want)


def test_a_table_with_padding_idx_is_refused() -> None:
    # swapped in as a one-row weight read at id 0, the padding index would zero the
    # gradient of every example (padding_idx=0) or of none
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4, padding_idx=0)})
    data = [torch.tensor([[0], [3]]), torch.tensor([1.0, 0.0])]
    with pytest.raises(UnsupportedModelError, match="padding_idx=0"):
        check_tables(model, [TableSpec(param="emb.weight", data_index=0, column=0)], data)
