"""A job for the multi-process refusal tests: the mlp example, broken on purpose where
`JobConfig.options["fault"]` says, on every rank or on one (`options["fault_rank"]`).

`python -m cocoon_ckpt train --job tests.cocoon_ckpt.rank_jobs:build --job-option
fault=optimizer` runs it from the repository root.
"""

from __future__ import annotations

import os

import torch

from cocoon_ckpt import JobConfig
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts

__all__ = ["build"]


def build(config: JobConfig) -> JobParts:
    """The mlp example's parts; with `fault` "optimizer", an Adam the config does not
    name; with "dataset", one example fewer than `dataset_size`; with "half", a float16
    model (refused by the trainer's model checks); with "content", every input shifted by
    one (the same size, another digest)."""
    parts = mlp.build(config)
    rank = config.options.get("fault_rank")
    if rank is not None and int(os.environ.get("RANK", "0")) != rank:
        return parts
    fault = config.options.get("fault")
    optimizer, data = parts.optimizer, parts.dataset
    if fault == "optimizer":
        optimizer = torch.optim.Adam(parts.model.parameters(), lr=config.lr)
    elif fault == "dataset":
        x, y = data  # type: ignore[misc]
        data = (x[:-1], y[:-1])
    elif fault == "content":
        x, y = data  # type: ignore[misc]
        data = (x + 1, y)
    elif fault == "half":
        parts.model.half()
    return JobParts(model=parts.model, optimizer=optimizer, loss_fn=parts.loss_fn, dataset=data)
