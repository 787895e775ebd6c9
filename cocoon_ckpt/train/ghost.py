"""Ghost clipping: the clipped per-sample gradient sum without per-sample gradients of
nn.Linear, nn.LayerNorm and nn.Embedding (`DPConfig.clipping="ghost"`).

Each chunk of the batch is run through the model once, batched, while hooks keep every
covered layer's input a and output s. One backward of the summed per-sample losses gives
the output gradients g = dl_i/ds_i, from which each example's gradient norm follows
without forming the gradient (Li et al. 2022, Bu et al. 2023 "fastDP"):

- Linear, input (m, T, d), output gradient (m, T, p): ||G_i||^2 =
  <a_i a_i^T, g_i g_i^T> (the ghost norm, m T^2 (d + p) work) or, where T (d + p) > p d,
  the direct ||g_i^T a_i||^2 ((m, p, d) for that layer only); bias ||sum_t g_it||^2.
- LayerNorm: the per-sample weight gradient sum_t g_it * xhat_it is (m, d) anyway, formed.
- Embedding: ||G_i||^2 = sum over token pairs with the same row of <g_it, g_is>.

A layer called several times (shared blocks) has its calls joined along T, which is its
per-sample gradient's sum. With the clip factors c_i = min(1, C / (||G_i|| + 1e-6)), the
clipped sum is formed from what the norms kept, without a second backward
(book-keeping, Bu et al. 2023): sum_i c_i g_i^T a_i in one GEMM over the chunk's tokens
for a Linear weight, c @ (per-sample rows) where those were formed anyway (biases,
LayerNorm, a direct-norm Linear), torch's embedding backward of the scaled output
gradients for an Embedding. Measured on the 4-block, d-256 transformer of
bench/scale.py: the clipped sum takes 1.44x a non-private forward and backward on the
same chunks (a second, reweighted backward took 1.71x; vmap 2.1x).

Any other module holding trainable parameters takes the per-sample gradients of those
parameters only, by a vmap of the module's own forward over the inputs and output
gradients its hook kept (the reason is logged once). A trainable parameter used outside
its module's forward (tied weights, a functional call on another module's weight) would
make a norm too small, which a privacy guarantee cannot afford: a tensor shared under
two names is refused when built, and every use is checked during the forward pass (a
torch function mode), refused by name.

The result is a pure function of (parameters, batch, physical batch size) on a device
type, as the vmap path's is, and agrees with it to float rounding (not bit for bit: the
two take different GEMMs).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call, vjp, vmap
from torch.overrides import TorchFunctionMode

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.errors import UnsupportedModelError
from cocoon_ckpt.train.grads import (
    ClippedSum,
    LossFn,
    PerSampleGrads,
    _nonfinite,
)

__all__ = ["GhostGrads", "linear_norm_mode"]

log = logging.getLogger(__name__)

_FIX = "use --clipping vmap (DPConfig.clipping='vmap')"

#: Functions and properties of a parameter that carry no gradient from it (metadata,
#: fresh tensors): a use outside its module's forward that cannot make a norm too small.
#: A property that does carry one (`.T`, `.mT`) is checked like any other use.
_NO_GRADIENT = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "layout",
        "ndim",
        "is_cuda",
        "is_leaf",
        "requires_grad",
        "grad",
        "data",
        "itemsize",
        "nbytes",
        "size",
        "dim",
        "numel",
        "stride",
        "detach",
        "data_ptr",
        "is_contiguous",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
    }
)


def linear_norm_mode(tokens: int, d_in: int, d_out: int) -> str:
    """Which per-sample norm of a Linear weight costs less: `ghost` (T^2 (d + p) per
    example, (m, T, T) memory) or `direct` (T p d, (m, p, d) memory). One token is
    always `ghost`: ||a||^2 ||g||^2."""
    return "ghost" if tokens * (d_in + d_out) <= d_in * d_out or tokens == 1 else "direct"


#: (clip scales (m,), a zeroed (numel,) place in the flat sum or None) -> one parameter's
#: clipped sum over the chunk (its shape or flat), or None once written into that place
_Sum = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor | None]

#: torch's CPU allocator aligns every tensor to 64 bytes; a GEMM writes into a place of
#: the flat sum only at that alignment, so it runs as it would into a fresh tensor
_ALIGN = 64


@dataclass
class _Layer:
    """A module holding trainable parameters, and how its norms are taken."""

    name: str
    module: nn.Module
    kind: str  # "linear", "layernorm", "embedding" or "per-sample"
    params: dict[str, nn.Parameter]  # its own trainable parameters, by local name
    calls: list[tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None, int]] = field(
        default_factory=list
    )  # per call: (args, kwargs, output (None once the backward has its edge), its version)


class GhostGrads(PerSampleGrads):
    """Per-sample clipped sums by ghost norms (see the module docstring).

    Args and checks as `PerSampleGrads`, and:

    Raises:
        UnsupportedModelError: embedding noise tables (they take per-row gradients), a
            trainable tensor held under two names, or an Embedding with `max_norm`,
            `sparse` or `scale_grad_by_freq` (they change the weight or couple examples).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        param_names: Sequence[str],
        *,
        tables: Sequence[TableSpec] = (),
    ) -> None:
        super().__init__(model, loss_fn, param_names, tables=tables, trace_after=None)
        if tables:
            raise UnsupportedModelError(
                f"clipping='ghost' does not serve embedding noise tables "
                f"({', '.join(s.param for s in tables)}: their gradients are taken per row); {_FIX}"
            )
        dense = set(self.param_names)
        for first, others in self._aliases:
            if first in dense:
                raise UnsupportedModelError(
                    f"parameter {first} is tied to {', '.join(others)}: ghost clipping takes "
                    f"each layer's norm on its own, so a tied weight's would be too small; {_FIX}"
                )
        self.layers: list[_Layer] = []
        for mname, mod in model.named_modules():
            own = {
                k: p
                for k, p in mod.named_parameters(recurse=False)
                if (f"{mname}.{k}" if mname else k) in dense
            }
            if own:
                self.layers.append(_Layer(mname or "<model>", mod, _kind(mname, mod), own))
        offsets = [0, *itertools.accumulate(self.sizes)]
        #: per parameter (by id), its (offset, numel) in the flat sum
        self._place = {id(p): (offsets[i], self.sizes[i]) for i, p in enumerate(self._dense)}
        self._owner = {id(p): layer for layer in self.layers for p in layer.params.values()}
        self._names = {
            id(p): f"{layer.name}.{k}" for layer in self.layers for k, p in layer.params.items()
        }
        fallback = [
            f"{x.name} ({type(x.module).__name__})" for x in self.layers if x.kind == "per-sample"
        ]
        if fallback:
            log.info(
                "ghost clipping: %s take per-sample gradients of their own parameters "
                "(ghost norms cover nn.Linear, nn.LayerNorm and nn.Embedding)",
                ", ".join(fallback),
            )

    def clipped_sum(
        self,
        batch: Sequence[torch.Tensor],
        max_grad_norm: float,
        physical_batch_size: int | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> ClippedSum:
        """As `PerSampleGrads.clipped_sum`, by ghost norms and book-keeping.

        `out`: a (dim,) buffer of the sum's dtype and device that the sum is taken into
        (zeroed here, then returned as `summed`): the trainer's kept gradient buffer
        (`NoisyGradients.buffer`), so a step faults in no fresh (dim,) pages (343 MB at
        85.9M parameters). None: a new tensor. It is zeroed after the first chunk's
        backward, right before the first sum is added: until then a trainer's first
        step leaves its pages to the thread faulting them in (`train.warm.fault_in`).

        Raises:
            ValueError: physical_batch_size < 1 or the tensors disagree on n.
            UnsupportedModelError: a trainable parameter was used outside its module's
                forward, a layer's output was changed in place, or a module without
                ghost norms could not be vmapped.
        """
        n = int(batch[0].shape[0]) if batch else 0
        if n == 0 or (physical_batch_size is not None and physical_batch_size < 1):
            return super().clipped_sum(batch, max_grad_norm, physical_batch_size)
        if any(int(d.shape[0]) != n for d in batch):
            raise ValueError(
                f"batch tensors disagree on the number of examples: {[d.shape[0] for d in batch]}"
            )
        device = self._dense[0].device if self._dense else None
        step = n if physical_batch_size is None else physical_batch_size
        # one flat sum for the batch, each chunk's parts added into their places in chunk
        # order (0 + x is x): a second (dim,) buffer per chunk was 343 MB at 85M
        if out is None:
            summed = torch.zeros(self.dim, dtype=self.dtype, device=device)
        elif (
            out.shape != (self.dim,)
            or out.dtype != self.dtype
            or (device is not None and out.device != device)
        ):
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} on {out.device}; the clipped sum is "
                f"({self.dim},) {self.dtype} on {device}"
            )
        else:
            summed = out  # zeroed by the first chunk, before its sums are added
        losses: list[torch.Tensor] = []
        norms: list[torch.Tensor] = []
        for a in range(0, n, step):
            chunk = [d[a : a + step] for d in batch]
            if device is not None:
                chunk = [d.to(device, non_blocking=True) for d in chunk]
            with torch.enable_grad():
                loss, norm = self._ghost_chunk(
                    chunk,
                    max_grad_norm,
                    summed,
                    zero_first=a == 0 and out is not None,
                    zeroed=a == 0,
                )
            losses.append(loss)
            norms.append(norm)
        loss = losses[0] if len(losses) == 1 else torch.cat(losses)
        return ClippedSum(summed, float(loss.mean()), [], _nonfinite(norms))

    def _ghost_chunk(
        self,
        chunk: list[torch.Tensor],
        max_grad_norm: float,
        summed: torch.Tensor,
        *,
        zero_first: bool = False,
        zeroed: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chunk, its clipped sum added into `summed` (dim,), zeroed first if
        `zero_first`; `zeroed`: `summed` is all zeros when the sums are added (the first
        chunk), so a sum may be written straight into its place: (per-sample losses (m,),
        gradient norms (m,)).

        What the chunk holds is let go as soon as it is used: the layers' outputs before
        the backward, which takes their gradient edges instead (autograd frees each
        output's memory as it passes it), each output gradient once its layer's norm is
        taken, and each layer's inputs and output gradients once its sum is added. At
        85.9M, physical batch 8, the peak of live tensors fell 282 -> 197 MiB, the
        forward's own (torch's allocator events); held to the end, they had made the
        book-keeping's the peak."""
        m = int(chunk[0].shape[0])
        sums: list[tuple[_Layer, dict[str, _Sum]]] = []
        try:
            out = self._forward(chunk[:-1], m)
            if not isinstance(out, torch.Tensor):
                raise UnsupportedModelError(
                    f"clipping='ghost' takes models whose output is one tensor; "
                    f"{type(self.model).__name__} returned {type(out).__name__}; {_FIX}"
                )
            loss_fn = self.loss_fn
            losses = vmap(lambda o, y: loss_fn(o.unsqueeze(0), y.unsqueeze(0)))(out, chunk[-1])
            edges, unused = self._edges()
            # the one backward: output gradients only (no parameter gradient is formed),
            # taken at the outputs' gradient edges, so no output outlives its node
            gouts: list[torch.Tensor | None] = []
            if edges:
                gouts.extend(torch.autograd.grad(losses.sum(), edges, allow_unused=True))
            del edges
            sq = torch.zeros(m, dtype=self.dtype, device=out.device)
            start = 0
            for x in self.layers:
                k = len(x.calls)
                gs = []
                for i in range(start, start + k):
                    g = gouts[i]
                    shape, dtype, device = unused[i]
                    gs.append(torch.zeros(shape, dtype=dtype, device=device) if g is None else g)
                    gouts[i] = None  # this layer's norm holds what it needs
                start += k
                if k:
                    layer_sq, layer_sums = self._layer(x, gs, m)
                    sq += layer_sq
                    sums.append((x, layer_sums))
                del gs
        finally:
            for x in self.layers:
                x.calls.clear()
        norms = sq.sqrt()
        scale = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        # book-keeping: each parameter's clipped sum from what its norm kept, added into
        # its place in the flat sum (a layer that never ran adds nothing); each layer's
        # closures (its inputs and output gradients) are dropped once its sums are in
        if zero_first:
            summed.zero_()
        sums.reverse()
        while sums:
            x, layer_sums = sums.pop()
            for name in list(layer_sums):
                at, numel = self._place[id(x.params[name])]
                _add_sum(layer_sums.pop(name), scale, summed[at : at + numel], zeroed=zeroed)
        return losses.detach(), norms

    def _edges(
        self,
    ) -> tuple[list[GradientEdge], list[tuple[torch.Size, torch.dtype, torch.device]]]:
        """Every layer call's output as its gradient edge (in layer and call order), with
        its shape, dtype and device (the zero gradient of an output the loss does not
        use); the outputs themselves are let go.

        Raises:
            UnsupportedModelError: an output was changed in place after its forward.
        """
        edges: list[GradientEdge] = []
        meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        for x in self.layers:
            for i, (args, kwargs, o, version) in enumerate(x.calls):
                if o is None or o._version != version:
                    raise UnsupportedModelError(
                        f"the output of {x.name} ({type(x.module).__name__}) was changed in "
                        f"place after its forward (e.g. relu_): its output gradient is no "
                        f"longer the layer's; make that op out of place, or {_FIX}"
                    )
                edges.append(get_gradient_edge(o))
                meta.append((o.shape, o.dtype, o.device))
                x.calls[i] = (args, kwargs, None, version)
        return edges, meta

    def _forward(self, inputs: list[torch.Tensor], m: int) -> Any:
        """The model on one chunk, keeping every layer's calls and checking each use of
        a trainable parameter against the modules running."""
        running: list[int] = []
        owner, names = self._owner, self._names
        misuse: list[str] = []

        def pre(mod: nn.Module, args: Any) -> None:
            running.append(id(mod))

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            running.pop()

        def keep(layer: _Layer) -> Callable[..., None]:
            def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
                if not isinstance(out, torch.Tensor):
                    raise UnsupportedModelError(
                        f"module {layer.name} ({type(mod).__name__}) returned "
                        f"{type(out).__name__}, not a tensor: its output gradient cannot be "
                        f"kept; {_FIX}"
                    )
                first = args[0] if args else None
                batched = out.dim() > 0 and int(out.shape[0]) == m
                if layer.kind != "per-sample":
                    batched &= isinstance(first, torch.Tensor) and first.dim() > 0
                    batched &= isinstance(first, torch.Tensor) and int(first.shape[0]) == m
                if not batched:
                    shape = list(first.shape) if isinstance(first, torch.Tensor) else first
                    raise UnsupportedModelError(
                        f"module {layer.name} ({type(mod).__name__}) was called on {shape} -> "
                        f"{list(out.shape)} in a chunk of {m} examples: ghost clipping needs "
                        f"the batch first in a layer's input and output (batch_first=True; "
                        f"expand a table read without it, such as positions); {_FIX}"
                    )
                layer.calls.append((args, kwargs, out, out._version))

            return hook

        class Uses(TorchFunctionMode):
            def __torch_function__(
                self,
                func: Any,
                types: Any,
                args: Sequence[Any] = (),
                kwargs: dict[str, Any] | None = None,
            ) -> Any:
                name = getattr(func, "__name__", str(func))
                if name == "__get__":  # a property: its own name says what it reads
                    name = str(getattr(getattr(func, "__self__", None), "__name__", name))
                for t in () if name in _NO_GRADIENT else (*args, *(kwargs or {}).values()):
                    layer = owner.get(id(t))
                    if layer is not None and id(layer.module) not in running:
                        misuse.append(f"{names[id(t)]} (in {name})")
                return func(*args, **(kwargs or {}))

        handles = []
        try:
            for mod in self.model.modules():
                handles.append(mod.register_forward_pre_hook(pre))
                handles.append(mod.register_forward_hook(post, always_call=True))
            for x in self.layers:
                handles.append(x.module.register_forward_hook(keep(x), with_kwargs=True))
            with Uses():
                out = self.model(*inputs)
        finally:
            for h in handles:
                h.remove()
        if misuse:
            raise UnsupportedModelError(
                f"trainable parameter {misuse[0]} is used outside its own module's forward "
                f"(a tied or borrowed weight): ghost clipping would miss that use in its "
                f"norm; {_FIX}"
            )
        return out

    def _layer(
        self, x: _Layer, gs: list[torch.Tensor], m: int
    ) -> tuple[torch.Tensor, dict[str, _Sum]]:
        """Per-example squared gradient norms (m,) of one layer's trainable parameters,
        and per parameter the function of the clip scales (m,) giving its clipped sum."""
        dt = self.dtype
        mod = x.module
        if x.kind == "per-sample":
            return self._per_sample(x, gs, m)
        g = _join([gi.reshape(m, -1, gi.shape[-1]) for gi in gs]).to(dt)
        p = g.shape[2]
        sq = torch.zeros(m, dtype=dt, device=g.device)
        sums: dict[str, _Sum] = {}
        if "bias" in x.params:  # Linear's and LayerNorm's: sum_t g_it per example
            gb = g.sum(1)
            sq += gb.square().sum(1)
            sums["bias"] = lambda c, _: c @ gb
        if x.kind == "linear":
            if "weight" in x.params:
                a = _join([c[0][0].detach().reshape(m, -1, c[0][0].shape[-1]) for c in x.calls])
                a = a.to(dt)
                tokens, d = a.shape[1], a.shape[2]
                if linear_norm_mode(tokens, d, p) == "ghost":
                    if tokens == 1:
                        sq += a.square().sum((1, 2)) * g.square().sum((1, 2))
                    else:
                        aa = torch.bmm(a, a.transpose(1, 2))
                        sq += (aa * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
                    # sum_i c_i g_i^T a_i: one GEMM over the chunk's tokens
                    sums["weight"] = functools.partial(_linear_sum, g, a)
                else:
                    per = torch.bmm(g.transpose(1, 2), a)  # (m, p, d): this layer's only
                    sq += per.square().sum((1, 2))
                    sums["weight"] = lambda c, _: c @ per.reshape(m, -1)
        elif x.kind == "layernorm":
            ln = cast(nn.LayerNorm, mod)
            if "weight" in x.params:
                shape = tuple(ln.normalized_shape)
                xhat = _join(
                    [
                        nn.functional.layer_norm(
                            c[0][0].detach(), shape, None, None, ln.eps
                        ).reshape(m, -1, p)
                        for c in x.calls
                    ]
                ).to(dt)
                gw = (g * xhat).sum(1)  # (m, D): the per-sample weight gradients
                sq += gw.square().sum(1)
                sums["weight"] = lambda c, _: c @ gw
        else:  # embedding
            emb = cast(nn.Embedding, mod)
            ids = _join([c[0][0].reshape(m, -1) for c in x.calls])
            same = ids[:, :, None] == ids[:, None, :]
            pad = -1 if emb.padding_idx is None else emb.padding_idx
            if emb.padding_idx is not None:
                kept = ids != emb.padding_idx
                same &= kept[:, :, None] & kept[:, None, :]
            sq += (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))
            rows = emb.num_embeddings
            # torch's own embedding backward of the scaled output gradients
            sums["weight"] = lambda c, _: torch.ops.aten.embedding_dense_backward(
                g * c[:, None, None], ids, rows, pad, False
            )
        return sq, sums

    def _per_sample(
        self, x: _Layer, gs: list[torch.Tensor], m: int
    ) -> tuple[torch.Tensor, dict[str, _Sum]]:
        """`_layer` for a module without ghost norms: its own per-sample gradients, by a
        vmap of its forward alone over each call's inputs and output gradient."""
        mod, names = x.module, list(x.params)
        values = {k: p.detach() for k, p in x.params.items()}
        total: dict[str, torch.Tensor] = {}
        for (args, kwargs, _, _), g in zip(x.calls, gs, strict=True):
            flat = [*args, *kwargs.values()]
            batched = [
                isinstance(t, torch.Tensor) and t.dim() > 0 and int(t.shape[0]) == m for t in flat
            ]
            keys = list(kwargs)

            def one(
                gi: torch.Tensor,
                *items: Any,
                nargs: int = len(args),
                batched: list[bool] = batched,
                keys: list[str] = keys,
            ) -> Any:
                full = [t.unsqueeze(0) if b else t for t, b in zip(items, batched, strict=True)]
                call_args = tuple(full[:nargs])
                call_kwargs = dict(zip(keys, full[nargs:], strict=True))

                def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
                    out: torch.Tensor = functional_call(mod, p, call_args, call_kwargs)
                    return out

                back = vjp(f, values)[1]
                return back(gi.unsqueeze(0))[0]

            items = [t.detach() if isinstance(t, torch.Tensor) else t for t in flat]
            dims = (0, *[0 if b else None for b in batched])
            try:
                per = vmap(one, in_dims=dims)(g.detach(), *items)
            except (RuntimeError, ValueError) as exc:
                raise UnsupportedModelError(
                    f"module {x.name} ({type(mod).__name__}) has no ghost norm and its "
                    f"per-sample gradients could not be taken by a vmap of its forward: "
                    f"{exc}; {_FIX}"
                ) from exc
            for k in names:
                total[k] = per[k] if k not in total else total[k] + per[k]
        flat_grads = {k: total[k].reshape(m, -1).to(self.dtype) for k in names}
        sq = torch.stack([v.square().sum(1) for v in flat_grads.values()]).sum(0)
        return sq, {k: functools.partial(_weighted, v) for k, v in flat_grads.items()}


def _weighted(per: torch.Tensor, c: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    """sum_i c_i per_i of per-sample rows (m, numel)."""
    return c @ per


def _linear_sum(
    g: torch.Tensor, a: torch.Tensor, c: torch.Tensor, into: torch.Tensor | None
) -> torch.Tensor | None:
    """A Linear weight's clipped sum sum_i c_i g_i^T a_i (p, d) from output gradients g
    (m, T, p) and inputs a (m, T, d): one GEMM over the chunk's tokens. Written into
    `into` (a zeroed (p d,) place, contiguous, at torch's alignment: the same GEMM as
    into a fresh tensor, so the same bits) and None returned, else returned: a (p, d)
    tensor of up to 9 MiB a layer at 85.9M the allocator need not find."""
    p, d = g.shape[2], a.shape[2]
    gc = (g * c[:, None, None]).reshape(-1, p).T
    # only on the CPU, whose allocator's alignment this matches (CUDA's is 512 bytes)
    if into is None or into.device.type != "cpu" or into.data_ptr() % _ALIGN:
        return gc @ a.reshape(-1, d)
    torch.mm(gc, a.reshape(-1, d), out=into.view(p, d))
    return None


def _add_sum(fn: _Sum, c: torch.Tensor, place: torch.Tensor, *, zeroed: bool) -> None:
    """Add one parameter's clipped sum `fn(c)` into its `place` (numel,) of the flat sum,
    written there directly when `place` is `zeroed` and `fn` can: then + 0.0, which is
    what adding into zeros did (-0.0 becomes 0.0; every other value is kept)."""
    r = fn(c, place if zeroed else None)
    if r is None:
        place.add_(0.0)
    else:
        place.add_(r.reshape(-1))


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The calls of one layer along T (no copy for the usual single call)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _kind(name: str, mod: nn.Module) -> str:
    """How a module's norms are taken; a refusal for layers no path serves."""
    if type(mod) is nn.Linear:
        return "linear"
    if type(mod) is nn.LayerNorm:
        return "layernorm"
    if type(mod) is nn.Embedding:
        for flag, bad in (
            ("max_norm", mod.max_norm is not None),
            ("sparse", mod.sparse),
            ("scale_grad_by_freq", mod.scale_grad_by_freq),
        ):
            if bad:
                raise UnsupportedModelError(
                    f"embedding {name} has {flag} set: it renormalises the weight in place "
                    f"or couples examples in its gradient, so no per-sample norm exists "
                    f"under clipping='ghost'; {_FIX}"
                )
        return "embedding"
    return "per-sample"
