"""Per-sample gradients of embedding tables without a dense (B, R, dim) copy.

An example reads one row per table, so its gradient in that table is one row. Under
vmap each example's table weight is swapped for a (1, dim) tensor holding its own row
and its id for 0: the model's forward is unchanged and the gradient with respect to
that tensor is the example's row gradient. Clipping sees the exact per-example norm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.embedding.one_thread import one_thread
from cocoon_ckpt.errors import ConfigError, UnsupportedModelError

__all__ = ["SparseGrads", "check_tables", "gather_rows", "sparse_per_sample", "sum_rows"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: per table: (unique rows (k,) int64, summed clipped row gradients (k, dim))
SparseGrads = list[tuple[torch.Tensor, torch.Tensor]]


def check_tables(
    model: nn.Module, specs: Sequence[TableSpec], data: Sequence[torch.Tensor]
) -> None:
    """Each spec must name an nn.Embedding weight and an integer id column in range."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for spec in specs:
        if spec.param not in params:
            raise UnsupportedModelError(
                f"embedding table {spec.param!r} is not a parameter of "
                f"{type(model).__name__}; its parameters include {sorted(params)[:8]}"
            )
        mod = modules.get(spec.param.rsplit(".", 1)[0] if "." in spec.param else "")
        if not isinstance(mod, nn.Embedding) or spec.param.rsplit(".", 1)[-1] != "weight":
            raise UnsupportedModelError(
                f"embedding table {spec.param!r} must be the weight of an nn.Embedding "
                f"(found {type(mod).__name__})"
            )
        if mod.max_norm is not None:
            raise UnsupportedModelError(
                f"embedding table {spec.param!r} has max_norm={mod.max_norm}: it renormalises "
                "rows in place during forward, which per-sample gradients cannot follow"
            )
        if mod.padding_idx is not None:
            # each example's weight is swapped for its own row at id 0 (module docstring),
            # so the padding index would zero the wrong examples' gradients
            raise UnsupportedModelError(
                f"embedding table {spec.param!r} has padding_idx={mod.padding_idx}: its "
                "per-sample row gradients would be wrong (every row is read at id 0 here); "
                "drop padding_idx; to mask padding, pass a 0/1 mask in another data column "
                "and multiply the looked-up rows by it (the id column reads 0 in forward here)"
            )
        if spec.data_index >= len(data) - 1:
            raise ConfigError(
                f"embedding table {spec.param!r}: data_index={spec.data_index} but there are "
                f"{len(data) - 1} input tensors (the last data tensor is the target)"
            )
        ids = data[spec.data_index]
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
            raise ConfigError(
                f"embedding table {spec.param!r}: data[{spec.data_index}] must be an (N, "
                f"columns) int tensor of ids, got {ids.dtype} {tuple(ids.shape)}"
            )
        if spec.column >= ids.shape[1]:
            raise ConfigError(
                f"embedding table {spec.param!r}: column={spec.column} but data"
                f"[{spec.data_index}] has {ids.shape[1]} columns"
            )
        col = ids[:, spec.column]
        rows = mod.num_embeddings
        if col.numel() and (int(col.min()) < 0 or int(col.max()) >= rows):
            raise ConfigError(
                f"embedding table {spec.param!r} has {rows} rows but its ids span "
                f"[{int(col.min())}, {int(col.max())}]"
            )


def sparse_per_sample(
    model: nn.Module, loss_fn: LossFn, specs: Sequence[TableSpec], n_data: int
) -> Callable[..., Any]:
    """vmap(grad) over (dense params, buffers, per-example rows, *data) ->
    ((dense grads, row grads), losses)."""
    names = [s.param for s in specs]

    def loss_one(
        p: dict[str, torch.Tensor],
        b: dict[str, torch.Tensor],
        rows: tuple[torch.Tensor, ...],
        *xy: torch.Tensor,
    ) -> torch.Tensor:
        params = dict(p)
        for name, r in zip(names, rows, strict=True):
            params[name] = r.unsqueeze(0)
        inputs = [x.unsqueeze(0) for x in xy[:-1]]
        out = functional_call(model, (params, b), tuple(inputs))
        return loss_fn(out, xy[-1].unsqueeze(0))

    return vmap(
        grad_and_value(loss_one, argnums=(0, 2)),
        in_dims=(None, None, 0, *([0] * n_data)),
        randomness="different",
    )


def gather_rows(
    weights: Sequence[torch.Tensor], specs: Sequence[TableSpec], batch: list[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The ids each example reads per table, and its rows; zeroes those id columns in
    `batch` (copies the id tensors first).

    Args:
        weights: the tables' weights, (R_i, dim_i) each, in `specs` order.
        specs: the tables.
        batch: the chunk's tensors, each (m, ...); the id tensors are replaced by copies.

    Returns:
        Per table the ids (m,) int64 and the rows (m, dim_i).
    """
    ids: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    with one_thread():  # a batch of small gathers (one_thread says why)
        # one column gather and one zeroing per id tensor, not four small ops per table:
        # dispatch dominates at a batch of ids (bench/dlrm.py's 26 tables, 1030 ids:
        # 1.5-1.6 ms CPU a step before, 0.7-0.8 ms this way); same values
        for index in dict.fromkeys(s.data_index for s in specs):
            mine = [i for i, s in enumerate(specs) if s.data_index == index]
            cols = [specs[i].column for i in mine]
            src = batch[index]
            picked = src[:, cols].to(torch.int64).t().contiguous()  # (tables, m)
            batch[index] = src.clone()
            batch[index][:, cols] = 0
            for k, i in enumerate(mine):
                ids[i] = picked[k]
        rows = tuple(
            torch.index_select(w.detach(), 0, r) for w, r in zip(weights, ids, strict=True)
        )
    return ids, rows


def sum_rows(
    ids: torch.Tensor, grads: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows and their summed clipped gradients (k,), (k, dim)."""
    with one_thread():  # a batch of rows: too small for torch's threads (one_thread)
        uniq, inv = torch.unique(ids, return_inverse=True)
        out = torch.zeros(uniq.numel(), grads.shape[-1], dtype=grads.dtype, device=grads.device)
        out.index_add_(0, inv, grads * scale.to(grads.dtype)[:, None])
    return uniq, out
