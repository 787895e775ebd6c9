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
from cocoon_ckpt.errors import UnsupportedModelError

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
        if spec.data_index >= len(data) - 1:
            raise ValueError(
                f"embedding table {spec.param!r}: data_index={spec.data_index} but there are "
                f"{len(data) - 1} input tensors (the last data tensor is the target)"
            )
        ids = data[spec.data_index]
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
            raise ValueError(
                f"embedding table {spec.param!r}: data[{spec.data_index}] must be an (N, "
                f"columns) int tensor of ids, got {ids.dtype} {tuple(ids.shape)}"
            )
        if spec.column >= ids.shape[1]:
            raise ValueError(
                f"embedding table {spec.param!r}: column={spec.column} but data"
                f"[{spec.data_index}] has {ids.shape[1]} columns"
            )
        col = ids[:, spec.column]
        rows = mod.num_embeddings
        if col.numel() and (int(col.min()) < 0 or int(col.max()) >= rows):
            raise ValueError(
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
    model: nn.Module, specs: Sequence[TableSpec], batch: list[torch.Tensor]
) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The ids each example reads per table, and its rows; zeroes those id columns in
    `batch` (copies the id tensors first)."""
    params = dict(model.named_parameters())
    ids, rows = [], []
    copied: set[int] = set()
    with one_thread():  # a batch of small gathers (one_thread says why)
        for spec in specs:
            src = batch[spec.data_index]
            r = src[:, spec.column].to(torch.int64).clone()
            if spec.data_index not in copied:
                batch[spec.data_index] = src.clone()
                copied.add(spec.data_index)
            batch[spec.data_index][:, spec.column] = 0
            ids.append(r)
            rows.append(params[spec.param].detach()[r])
    return ids, tuple(rows)


def sum_rows(
    ids: torch.Tensor, grads: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique rows and their summed clipped gradients (k,), (k, dim)."""
    with one_thread():  # a batch of rows: too small for torch's threads (one_thread)
        uniq, inv = torch.unique(ids, return_inverse=True)
        out = torch.zeros(uniq.numel(), grads.shape[-1], dtype=grads.dtype, device=grads.device)
        out.index_add_(0, inv, grads * scale.to(grads.dtype)[:, None])
    return uniq, out
