"""examples/dlrm: a small DLRM (dense MLP + embedding tables) on synthetic Zipf features.

Options: `tables` (a list of row counts, or "criteo-kaggle": the 26 tables of the
Criteo Kaggle set as published with the DLRM reference, times `scale`), `dim`, `dense`,
`zipf` (the exponent), `dtype`. The job declares its tables (`JobParts.tables`), so a
config with `embedding` set gives them per-row gradients and embedding noise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.parts import JobParts, make_optimizer

if TYPE_CHECKING:
    from cocoon_ckpt.train.config import JobConfig

DEFAULTS: dict[str, Any] = {
    "dense": 13,
    "tables": [500, 300, 200, 100],
    "dim": 8,
    "zipf": 1.1,
    "scale": 1.0,
    "dtype": "float32",
}

#: Rows of the 26 categorical features of Criteo Kaggle (the DLRM reference's counts).
CRITEO_KAGGLE_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip


def table_rows(tables: str | list[int], scale: float = 1.0) -> list[int]:
    """Row counts: a list as given, or "criteo-kaggle"; each times `scale` (>= 1 row)."""
    if isinstance(tables, str):
        if tables != "criteo-kaggle":
            raise ConfigError(f"tables={tables!r}: give a list of row counts or 'criteo-kaggle'")
        base = list(CRITEO_KAGGLE_ROWS)
    else:
        base = [int(r) for r in tables]
    if not scale > 0:
        raise ConfigError(f"scale={scale}: must be > 0")
    return [max(1, round(r * scale)) for r in base]


def zipf_ids(rows: int, n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """n row ids in [0, rows) with P(id = k) ~ (k+1)^-exponent, by inverse CDF of the
    continuous power law (O(n), fast at 10^7 rows). exponent must be > 0 and != 1."""
    if rows < 1:
        raise ConfigError(f"rows={rows} must be >= 1")
    if exponent <= 0 or exponent == 1.0:
        raise ConfigError(f"zipf exponent={exponent} must be > 0 and != 1")
    u = rng.random(n)
    a = 1.0 - exponent
    x = ((float(rows + 1) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    ids: np.ndarray = np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)
    return ids


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
        logits: torch.Tensor = self.top(feats).squeeze(-1)
        return logits


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
    rows = table_rows(opts["tables"], float(opts["scale"]))
    dtype = {"float32": torch.float32, "float64": torch.float64}[opts["dtype"]]
    torch.manual_seed(config.dp.seed)
    model = DLRM(opts["dense"], rows, opts["dim"]).to(dtype)
    x, ids, y = make_data(
        config.dp.dataset_size,
        opts["dense"],
        rows,
        opts["zipf"],
        config.dp.seed + 1,
    )
    opt = make_optimizer(config.optimizer, list(model.parameters()), config.lr)
    return JobParts(
        model=model,
        optimizer=opt,
        loss_fn=nn.functional.binary_cross_entropy_with_logits,
        data=(x.to(dtype), ids, y.to(dtype)),
        tables=[
            TableSpec(param=f"tables.{i}.weight", data_index=1, column=i) for i in range(len(rows))
        ],
    )
