"""The noisy gradient of one DP step: (clipped sum + w_t) / B, set as the dense
parameters' `.grad` on the model's device."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from cocoon_ckpt.dp.elementwise import add_div_into
from cocoon_ckpt.train.warm import fault_in

__all__ = ["NoisyGradients"]


class NoisyGradients:
    """Sets the parameters' gradients from a clipped sum and the step's noise.

    Args:
        model: the trained module.
        param_names: its dense trainable parameters, in the flat sum's order.
        batch_size: B, the expected (logical) batch size the sum is divided by.

    The Parameter objects are looked up once: a module keeps them (`.to()` and an
    in-place `load_state_dict` change their data, not the objects), and the optimizer
    holds the same ones.

    The gradients are views into one flat buffer kept from step to step (as DDP's
    gradient buckets are with `gradient_as_bucket_view`), written whole each step: no
    allocation, split or per-parameter assignment on the step's path (with the
    optimizer's `zero_grad` this was 0.1 ms of a 1.4 ms step of bench/dp_step.py's
    digits MLP). A parameter whose dtype is not the sum's gets a fresh gradient each
    step instead.

    `reserve`, called when the trainer is built, makes that buffer there and faults its
    pages in off the training thread (`train.warm.fault_in`), so the first step does not
    pay for them.
    """

    def __init__(self, model: nn.Module, param_names: Sequence[str], batch_size: int) -> None:
        params = dict(model.named_parameters())
        self.params = [params[k] for k in param_names]
        self.sizes = [p.numel() for p in self.params]
        self.batch_size = batch_size
        self._flat: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        #: the thread faulting in the buffer's pages (None: none started)
        self.faulting: threading.Thread | None = None

    def reserve(self, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor | None:
        """Make the kept buffer now (`buffer`) and fault its pages in on a daemon thread
        (on the CPU; a CUDA buffer is left to its allocator). No value depends on it: the
        thread writes no byte, and the buffer is written whole before it is read."""
        flat = self.buffer(dtype, device)
        if flat is not None and self.faulting is None:
            self.faulting = fault_in([flat])
        return flat

    def set(self, summed: torch.Tensor, w: torch.Tensor) -> None:
        """`p.grad` = the parameter's slice of (summed + w) / B.

        Args:
            summed: (dim,) clipped per-sample gradient sum, on the model's device.
            w: (dim,) w_t, on the host (`train.device`: drawn there); copied to the sum's
                device and dtype (a no-op on the CPU in the same dtype).
        """
        w = w.to(summed.device, summed.dtype)
        flat = self.buffer(summed.dtype, summed.device)
        if flat is None:
            noisy = (summed + w) / self.batch_size
            for p, g in zip(self.params, torch.split(noisy, self.sizes), strict=True):
                p.grad = g.view(p.shape).to(p.dtype)
            return
        # (summed + w) / B with the bits of torch's two kernels, in one pass into the
        # kept buffer (which may be `summed` itself: each element is read, then written)
        add_div_into(flat, summed, w, self.batch_size)
        for p, g in zip(self.params, self._views, strict=True):
            if p.grad is not g:  # first step, or someone set it to None or replaced it
                p.grad = g

    def buffer(self, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor | None:
        """The kept flat gradient buffer, (dim,) of `dtype` on `device` (made or remade
        here), or None when a parameter cannot take a view of it.

        A clipped sum may be taken into it (`GhostGrads.clipped_sum(out=)`): `set` then
        adds the noise in place, and the step allocates no (dim,) sum of its own. Its
        values (the previous step's gradients) are overwritten by whoever writes it."""
        device = torch.device("cpu") if device is None else device
        flat = self._flat
        if flat is not None and flat.dtype == dtype and flat.device == device:
            return flat
        if any(p.dtype != dtype or p.device != device for p in self.params):
            return None
        flat = self._flat = torch.empty(sum(self.sizes), dtype=dtype, device=device)
        self._views = [
            g.view(p.shape) for p, g in zip(self.params, torch.split(flat, self.sizes), strict=True)
        ]
        return flat
