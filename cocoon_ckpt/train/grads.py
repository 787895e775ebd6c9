"""Clipped per-sample gradient sums, taken in physical chunks of the logical batch.

A Poisson batch (the logical batch, expected size B) goes through
`torch.func.vmap(grad_and_value(...))` at most `physical_batch_size` examples at a time:
each chunk's per-sample gradients are clipped to `max_grad_norm`, summed with one GEMV
per parameter (`scale @ g`), and added to the running sum in chunk order, then freed.
Peak memory is that of one chunk's (chunk, dim) per-sample gradients, not the batch's.

The sum is a pure function of (parameters, batch, physical_batch_size), not of the
chunk size alone: the per-sample gradients themselves change in the last bits with the
number of examples vmap takes at once (BLAS picks its GEMM kernel by the row count;
measured on an MLP, chunks of 1, 3 and 7 differ from one of 256 by up to 3e-7 while
chunks of 64 agree), so no summation order can make every chunk size agree. The
physical batch size is therefore part of what a job's result depends on (fingerprint
it). With `physical_batch_size=None` the sum is today's single-vmap sum, bit for bit.

A model without embedding tables is served, once two chunk sizes are seen, by the aten
ops its chunks dispatch, replayed without torch.func's wrappers (`train.traced_grads`):
the same ops on the same shapes, so the same bits, which every chunk size checks on its
first use; whatever cannot be replayed (random ops, values read in Python) runs eagerly,
with the reason logged. `trace_after=None` keeps the eager path on every chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.embedding.sparse import SparseGrads, gather_rows, sparse_per_sample, sum_rows
from cocoon_ckpt.errors import ConfigError, UnsupportedModelError
from cocoon_ckpt.train.traced_grads import ChunkFn, TracedChunk

__all__ = [
    "TRACE_AFTER",
    "ClippedSum",
    "PerSampleGrads",
    "check_per_sample",
    "clip_and_sum",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: eager chunks (per model state and input shapes) before the chunk is recorded
TRACE_AFTER = 0


class ClippedSum(NamedTuple):
    """The clipped sum of one batch (or of this process's part of it)."""

    summed: torch.Tensor
    """(dim,) sum of the clipped per-sample gradients of the dense parameters, in
    `param_names` order; zeros for an empty batch."""
    loss: float
    """Mean per-sample loss (nan for an empty batch)."""
    table_grads: SparseGrads
    """Per embedding table: (unique rows (k,) int64, summed clipped row gradients
    (k, dim)); empty when there are no tables."""
    nonfinite: list[int]
    """Positions in the batch (0-based, in batch order) of the examples whose
    per-sample gradient norm is not finite; empty for a finite batch. Clipping cannot
    bound such a gradient (NaN stays NaN, and 0 * inf is NaN), so `summed` is not
    finite then and must not be used."""


def check_per_sample(model: nn.Module) -> None:
    """Refuse modules that mix examples within a batch.

    Raises:
        UnsupportedModelError: a BatchNorm module is in training mode.
    """
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise UnsupportedModelError(
                f"module {name or type(mod).__name__} is {type(mod).__name__} in training mode: "
                "it mixes examples within a batch, so per-sample gradients (and DP) do not "
                "exist; use GroupNorm or LayerNorm, or call .eval() on it"
            )


class PerSampleGrads:
    """Per-sample gradients of `model`, clipped and summed chunk by chunk.

    Args:
        model: any nn.Module torch.func can take per-sample gradients of.
        loss_fn: loss(output, target) -> scalar, mean over its batch dimension (called
            on one example at a time under vmap).
        param_names: the dense trainable parameters, in the order of the flat sum.
        tables: embedding tables whose gradients are taken per row
            (`cocoon_ckpt.embedding.sparse`); they must not be in `param_names`.
        trace_after: eager chunks (per key: modes, clip, layouts) before one is
            recorded for replay; None never records (set it before the first chunk).

    Every other parameter (frozen, or a table) and every buffer is passed as a constant.

    Raises:
        UnsupportedModelError: a BatchNorm in training mode, or trainable parameters not
            float32/float64.
        ValueError: a name is not a parameter of `model`, or a table is also in
            `param_names`.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        param_names: Sequence[str],
        *,
        tables: Sequence[TableSpec] = (),
        trace_after: int | None = TRACE_AFTER,
    ) -> None:
        check_per_sample(model)
        params = dict(model.named_parameters())
        unknown = [k for k in param_names if k not in params]
        if unknown:
            raise ConfigError(
                f"param_names {unknown} are not parameters of {type(model).__name__}; "
                f"its parameters include {sorted(params)[:8]}"
            )
        self.table_names = [s.param for s in tables]
        both = sorted(set(self.table_names) & set(param_names))
        if both:
            raise ConfigError(
                f"{both} are both embedding tables and dense parameters: leave tables out "
                "of param_names (their gradients are taken per row)"
            )
        dtypes = {params[k].dtype for k in param_names}
        if dtypes - {torch.float32, torch.float64}:
            raise UnsupportedModelError(
                f"trainable parameters must be float32/float64, got {dtypes}"
            )
        self.model = model
        self.loss_fn = loss_fn
        self.param_names = list(param_names)
        self.tables = list(tables)
        self.sizes = [params[k].numel() for k in self.param_names]
        self.dim = sum(self.sizes)
        self.dtype = torch.float64 if torch.float64 in dtypes else torch.float32
        # Looked up once: a module keeps its Parameter objects (`.to()` and an in-place
        # `load_state_dict` change their data, not them); buffers are read per step.
        self._dense = [params[k] for k in self.param_names]
        skip = set(self.param_names) | set(self.table_names)
        self._frozen = {k: p for k, p in params.items() if k not in skip}
        self._tables = [params[k] for k in self.table_names]
        self._aliases = _tied_aliases(model)
        self._submodules = list(model.modules())  # their training flags select a tape
        self._fns: dict[int, Callable[..., Any]] = {}
        self.trace_after = trace_after
        self._chunk_fns: dict[Hashable, ChunkFn | TracedChunk] = {}
        self._eager_chunks: dict[Hashable, int] = {}

    def clipped_sum(
        self,
        batch: Sequence[torch.Tensor],
        max_grad_norm: float,
        physical_batch_size: int | None = None,
    ) -> ClippedSum:
        """Sum of the batch's per-sample gradients, each clipped to `max_grad_norm`.

        Args:
            batch: the batch's tensors, each (n, ...); the last is the target. Each chunk
                is moved to the model's device as it is taken.
            max_grad_norm: C, the clipping norm (over dense parameters and table rows).
            physical_batch_size: most examples per vmap; None takes the batch at once.

        Returns:
            The clipped sum, the mean loss and the tables' row sums (see ClippedSum).

        Raises:
            ValueError: physical_batch_size < 1 or the tensors disagree on n.
            UnsupportedModelError: torch.func cannot take the model's per-sample
                gradients (in-place buffer updates, batch-coupled layers).
        """
        if physical_batch_size is not None and physical_batch_size < 1:
            raise ConfigError(f"physical_batch_size={physical_batch_size} must be >= 1 or None")
        n = int(batch[0].shape[0])
        if any(int(d.shape[0]) != n for d in batch):
            raise ValueError(
                f"batch tensors disagree on the number of examples: {[d.shape[0] for d in batch]}"
            )
        device = self._dense[0].device if self._dense else None
        params = {k: p.detach() for k, p in zip(self.param_names, self._dense, strict=True)}
        buffers = dict(self.model.named_buffers())
        buffers.update((k, p.detach()) for k, p in self._frozen.items())
        if n == 0:
            return ClippedSum(
                torch.zeros(self.dim, dtype=self.dtype, device=device),
                float("nan"),
                [
                    (
                        torch.zeros(0, dtype=torch.int64, device=t.device),
                        torch.zeros(0, t.shape[1], dtype=t.dtype, device=t.device),
                    )
                    for t in self._tables
                ],
                [],
            )
        step = n if physical_batch_size is None else physical_batch_size
        summed: torch.Tensor | None = None
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        rows: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        for a in range(0, n, step):
            chunk = [d[a : a + step] for d in batch]
            if device is not None:
                chunk = [d.to(device, non_blocking=True) for d in chunk]
            partial, loss, norm, row_parts = self._chunk(params, buffers, chunk, max_grad_norm)
            # chunk partials are added in chunk order: one association per chunk size
            summed = partial if summed is None else summed.add_(partial)
            losses.append(loss)
            norms.append(norm)
            rows.append(row_parts)
        if summed is None:  # unreachable for n > 0; keeps the type exact
            raise RuntimeError("no chunk was taken of a non-empty batch")
        tables = [
            sum_rows(
                torch.cat([r[i][0] for r in rows]),
                torch.cat([r[i][1] for r in rows]),
                torch.cat([r[i][2] for r in rows]),
            )
            for i in range(len(self.tables))
        ]
        # per-sample losses come with the gradients: no second forward pass for the report
        # (one chunk's losses are averaged as they are: a cat of one copies the same bits)
        loss = losses[0] if len(losses) == 1 else torch.cat(losses)
        return ClippedSum(summed, float(loss.mean()), tables, _nonfinite(norms))

    def _chunk(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        chunk: list[torch.Tensor],
        max_grad_norm: float,
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ]:
        """One chunk: (clipped dense sum (dim,), per-sample losses, per-sample gradient
        norms, per table (ids, row gradients, clip scales)); its per-sample gradients are
        freed on return."""
        if not self.tables:
            partial, losses, norms = self._dense_chunk(params, buffers, chunk, max_grad_norm)
            return partial, losses, norms, []
        m = int(chunk[0].shape[0])
        grads, row_grads, ids, losses = self.per_sample(params, buffers, chunk)
        per_param = [grads[k].reshape(m, -1) for k in self.param_names]
        scale, partial, norms = clip_and_sum(per_param, row_grads, max_grad_norm, self.dtype)
        rows = [(i, g, scale) for i, g in zip(ids, row_grads, strict=True)]
        return partial, losses, norms, rows

    def _dense_chunk(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        chunk: list[torch.Tensor],
        max_grad_norm: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A chunk of a model without tables, eagerly or by the recorded graph
        (`train.traced_grads`: the same ops, the same bits): (clipped sum, per-sample
        losses, per-sample gradient norms)."""
        fixed = [*params.values(), *buffers.values()]
        # what a tape depends on besides n: names, the clip, modes, layouts (a Python
        # decomposition may branch on strides); 11 us a chunk on the digits MLP
        key = (
            tuple(buffers),
            max_grad_norm,
            torch.is_grad_enabled(),
            tuple(m.training for m in self._submodules),
            tuple((t.shape, t.stride(), t.dtype, t.device) for t in fixed),
            tuple((t.shape[1:], t.stride()[1:], t.dtype, t.device) for t in chunk),
        )
        fn = self._chunk_fns.get(key)
        if fn is None:
            fn = self._chunk_fns[key] = self._flat_chunk(list(buffers), max_grad_norm)
        if not isinstance(fn, TracedChunk) and self.trace_after is not None:
            self._eager_chunks[key] = seen = self._eager_chunks.get(key, 0) + 1
            # a subclass that overrides per_sample is called on every chunk, as before
            if seen > self.trace_after and type(self).per_sample is PerSampleGrads.per_sample:
                fn = self._chunk_fns[key] = TracedChunk(fn)
        partial, losses, norms = fn(*fixed, *chunk)
        return partial, losses, norms

    def _flat_chunk(self, buffer_names: list[str], max_grad_norm: float) -> ChunkFn:
        """The eager chunk function on flat inputs (parameters, buffers, chunk tensors):
        `per_sample`, then `clip_and_sum`; the norms are returned too (computed for the
        clip anyway: an output of the tape, not another op)."""
        names = self.param_names
        n_params, n_fixed = len(names), len(names) + len(buffer_names)

        def chunk_fn(*flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            params = dict(zip(names, flat[:n_params], strict=True))
            buffers = dict(zip(buffer_names, flat[n_params:n_fixed], strict=True))
            grads, _, _, losses = self.per_sample(params, buffers, list(flat[n_fixed:]))
            m = int(flat[-1].shape[0])
            per_param = [grads[k].reshape(m, -1) for k in names]
            _, partial, norms = clip_and_sum(per_param, [], max_grad_norm, self.dtype)
            return partial, losses, norms

        return chunk_fn

    def per_sample(
        self,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        chunk: list[torch.Tensor],
    ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The vmap of one chunk of m examples.

        Returns:
            Per-sample gradients by parameter name, each (m, *shape); per table the row
            gradients (m, dim) and the ids each example read (m,) int64; losses (m,).

        Raises:
            UnsupportedModelError: torch.func failed on the model.
        """
        fn = self._fns.get(len(chunk))
        if fn is None:
            fn = self._fns[len(chunk)] = self._vmapped(len(chunk))
        try:
            if not self.tables:
                grads, losses = fn(params, buffers, *chunk)
                return grads, [], [], losses
            ids, rows = gather_rows(self._tables, self.tables, chunk)
            (grads, row_grads), losses = fn(params, buffers, rows, *chunk)
            return grads, list(row_grads), ids, losses
        except RuntimeError as exc:
            raise UnsupportedModelError(
                f"torch.func could not take per-sample gradients of {type(self.model).__name__}: "
                f"{exc}. Models with in-place buffer updates or batch-coupled layers have no "
                "per-sample path"
            ) from exc

    def _vmapped(self, n_data: int) -> Callable[..., Any]:
        if self.tables:
            return sparse_per_sample(self.model, self.loss_fn, self.tables, n_data)
        model, loss_fn, aliases = self.model, self.loss_fn, self._aliases

        def loss_one(
            p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *xy: torch.Tensor
        ) -> torch.Tensor:
            inputs = tuple(x.unsqueeze(0) for x in xy[:-1])
            values = {**p, **b}
            # Tied names get their tensor's value here, so functional_call need not
            # rebuild the module's tie map on every call (tie_weights=True does, at a
            # cost comparable to a small model's forward pass); the same substitution.
            for name, others in aliases:
                if name in values:
                    values.update(dict.fromkeys(others, values[name]))
            out = functional_call(model, values, inputs, tie_weights=False)
            return loss_fn(out, xy[-1].unsqueeze(0))

        return vmap(
            grad_and_value(loss_one),
            in_dims=(None, None, *([0] * n_data)),
            randomness="different",
        )


def clip_and_sum(
    per_param: list[torch.Tensor],
    row_grads: list[torch.Tensor],
    max_grad_norm: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip scales (m,) of one chunk, its clipped dense sum (dim,) and its per-sample
    gradient norms (m,), which the clip computed (`_nonfinite` reads them).

    Args:
        per_param: per dense parameter, the chunk's gradients (m, numel).
        row_grads: per table, the chunk's row gradients (m, dim).
        max_grad_norm: C.
        dtype: the sum's dtype when there are no dense parameters.
    """
    # Per parameter, never one (chunk, dim) copy: norms from per-parameter sums of
    # squares, then one GEMV (scale @ grads) per parameter.
    sq = [g.square().sum(dim=1) for g in per_param]
    sq += [g.reshape(g.shape[0], -1).square().sum(dim=1) for g in row_grads]
    norms = torch.stack(sq).sum(dim=0).sqrt()
    scale = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
    if per_param:
        partial = torch.cat([scale.to(g.dtype) @ g for g in per_param])
    else:
        partial = torch.zeros(0, dtype=dtype, device=scale.device)
    return scale, partial, norms


def _nonfinite(norms: list[torch.Tensor]) -> list[int]:
    """Positions of the non-finite per-sample gradient norms in the batch (chunks in
    order). One reduction and one read for a finite batch (3 us for 64 norms on one
    thread, against 12 us for isfinite().all()): a sum of non-negative norms is finite
    unless one is not, or they overflow together, which the exact look-up that follows
    tells apart."""
    every = norms[0] if len(norms) == 1 else torch.cat(norms)
    if math.isfinite(every.sum().item()):
        return []
    return [int(i) for i in torch.nonzero(~torch.isfinite(every)).flatten()]


def _tied_aliases(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Per tensor the module holds under several names (tied weights): the name
    `named_parameters()`/`named_buffers()` give it, and its other names."""
    names: dict[int, list[str]] = {}
    for named in (
        model.named_parameters(remove_duplicate=False),
        model.named_buffers(remove_duplicate=False),
    ):
        for k, t in named:
            names.setdefault(id(t), []).append(k)
    return [(ks[0], ks[1:]) for ks in names.values() if len(ks) > 1]
