"""examples/mlp: a small MLP on synthetic, seeded classification data (runs in seconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from cocoon_ckpt.train.parts import JobParts, make_optimizer

if TYPE_CHECKING:
    from cocoon_ckpt.train.config import JobConfig

DEFAULTS = {"features": 20, "hidden": 64, "classes": 4}


def make_data(n: int, features: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters, one per class: (n, features) float32 and (n,) int64 labels."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * 2.0
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return x, y


def build(config: JobConfig) -> JobParts:
    opts = {**DEFAULTS, **config.options}
    torch.manual_seed(config.dp.seed)
    model = nn.Sequential(
        nn.Linear(opts["features"], opts["hidden"]),
        nn.ReLU(),
        nn.Linear(opts["hidden"], opts["classes"]),
    )
    x, y = make_data(config.dp.dataset_size, opts["features"], opts["classes"], config.dp.seed + 1)
    opt = make_optimizer(config.optimizer, list(model.parameters()), config.lr)
    return JobParts(model=model, optimizer=opt, loss_fn=nn.functional.cross_entropy, data=(x, y))
