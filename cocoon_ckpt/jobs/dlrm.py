"""examples/dlrm: a small DLRM (dense MLP + embedding tables) on synthetic Zipf features.

The correlated noise covers the tables densely here; the embedding coalescer is
`cocoon_ckpt.embedding`'s business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from . import JobParts, make_optimizer

if TYPE_CHECKING:
    from ..config import JobConfig

DEFAULTS = {"dense": 13, "tables": [500, 300, 200, 100], "dim": 8, "zipf": 1.1}


def zipf_ids(rows: int, n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """n row ids in [0, rows) with P(id = k) ~ (k+1)^-exponent, by inverse CDF of the
    continuous power law (O(n), fast at 10^7 rows). exponent must be > 0 and != 1."""
    if rows < 1:
        raise ValueError(f"rows={rows} must be >= 1")
    if exponent <= 0 or exponent == 1.0:
        raise ValueError(f"zipf exponent={exponent} must be > 0 and != 1")
    u = rng.random(n)
    a = 1.0 - exponent
    x = ((float(rows + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)


class DLRM(nn.Module):
    """Bottom MLP over dense features, one embedding per table, dot interaction, top MLP."""

    def __init__(self, dense: int, tables: list[int], dim: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 16), nn.ReLU(), nn.Linear(16, dim))
        self.tables = nn.ModuleList(nn.Embedding(r, dim) for r in tables)
        k = len(tables) + 1
        self.top = nn.Sequential(nn.Linear(dim + k * (k - 1) // 2, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        z = self.bottom(dense)
        embs = [z] + [t(sparse[:, i]) for i, t in enumerate(self.tables)]
        stack = torch.stack(embs, dim=1)  # (B, k, dim)
        inter = torch.bmm(stack, stack.transpose(1, 2))
        iu = torch.triu_indices(stack.shape[1], stack.shape[1], offset=1)
        feats = torch.cat([z, inter[:, iu[0], iu[1]]], dim=1)
        return self.top(feats).squeeze(-1)


def make_data(
    n: int, dense: int, tables: list[int], zipf: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((n, dense)).astype(np.float32))
    ids = torch.from_numpy(np.stack([zipf_ids(r, n, zipf, rng) for r in tables], axis=1))
    w = rng.standard_normal(dense).astype(np.float32)
    logits = x.numpy() @ w + 0.5 * np.sin(ids.numpy().sum(axis=1))
    y = torch.from_numpy((logits > 0).astype(np.float32))
    return x, ids, y


def build(config: JobConfig) -> JobParts:
    opts = {**DEFAULTS, **config.options}
    torch.manual_seed(config.dp.seed)
    model = DLRM(opts["dense"], list(opts["tables"]), opts["dim"])
    x, ids, y = make_data(
        config.dp.dataset_size,
        opts["dense"],
        list(opts["tables"]),
        opts["zipf"],
        config.dp.seed + 1,
    )
    opt = make_optimizer(config.optimizer, list(model.parameters()), config.lr)
    return JobParts(
        model=model,
        optimizer=opt,
        loss_fn=nn.functional.binary_cross_entropy_with_logits,
        data=(x, ids, y),
    )
