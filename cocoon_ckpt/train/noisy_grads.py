"""The noisy gradient of one DP step: (clipped sum + w_t) / B, set as the dense
parameters' `.grad` on the model's device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

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
    """

    def __init__(self, model: nn.Module, param_names: Sequence[str], batch_size: int) -> None:
        params = dict(model.named_parameters())
        self.params = [params[k] for k in param_names]
        self.sizes = [p.numel() for p in self.params]
        self.batch_size = batch_size

    def set(self, summed: torch.Tensor, w: torch.Tensor) -> None:
        """`p.grad` = the parameter's slice of (summed + w) / B.

        Args:
            summed: (dim,) clipped per-sample gradient sum, on the model's device.
            w: (dim,) w_t, on the host (`train.device`: drawn there); copied to the sum's
                device and dtype (a no-op on the CPU in the same dtype).
        """
        noisy = (summed + w.to(summed.device, summed.dtype)) / self.batch_size
        # Gradients are views into `noisy`, a fresh buffer per step (as DDP's buckets are).
        for p, g in zip(self.params, torch.split(noisy, self.sizes), strict=True):
            p.grad = g.view(p.shape).to(p.dtype)
