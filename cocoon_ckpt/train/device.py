"""Where a job's tensors live: on the model's device, batches moved there as they come.

The model's dense trainable parameters name the device (CUDA where the user put the
model there): the batch is copied to it, and the per-sample gradients, the clipping, the
sum and the noise addition happen there.

The fresh noise z_t is not drawn there. The keyed generator draws it on the host (where
the ring history lives on its tiers anyway), the BandMF step runs on the tiers, and w_t
is copied to the model's device once per step (`NoisyGradients`). So I1 holds across
device types, not only per device type: a CUDA job's noise is bit for bit the CPU job's.
The price is one host-to-device copy of dim floats per step: 4 bytes x dim in float32,
e.g. 0.4 GB for a 100M-parameter model, about 8 ms over PCIe Gen5 x16 at ~50 GB/s (an
H200 on PCIe), ~1 ms over NVLink-C2C on a GH200 (~450 GB/s), next to the step's own
per-sample gradients of the same model (tens to hundreds of ms per logical batch).

The device type is still part of what a job is (`train.identity`): per-sample gradients
on another device type differ in the last bits (other kernels, other summation order),
so a resume on another device type is refused listing the difference.
"""

from __future__ import annotations

import torch
from torch import nn

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.data import Batch

__all__ = ["batch_to", "model_device"]


def model_device(model: nn.Module, param_names: list[str]) -> torch.device:
    """The device of the model's dense trainable parameters (`param_names`); the device of
    any parameter when there is none (an embedding-only model), the CPU for none at all.

    Raises:
        ConfigError: the dense trainable parameters lie on several devices.
    """
    params = dict(model.named_parameters())
    devices = {params[k].device for k in param_names}
    if len(devices) > 1:
        raise ConfigError(
            f"the model's trainable parameters lie on {sorted(str(d) for d in devices)}: "
            "the clipped sum and its noise are one vector on one device; move the model "
            "to one device (model.to(device)) before building the job"
        )
    if devices:
        return devices.pop()
    return next((p.device for p in params.values()), torch.device("cpu"))


def batch_to(batch: Batch, device: torch.device) -> Batch:
    """`batch` with its tensors on `device` (the same batch when they are there).

    From pinned memory (the DataLoader's `pin_memory=True`) the copy to a CUDA device is
    asynchronous; the per-sample gradients that read it are queued behind it on the same
    stream, so nothing waits for it on the host.
    """
    if all(t.device == device for t in batch.tensors):
        return batch
    return batch.to(device, non_blocking=device.type == "cuda")
