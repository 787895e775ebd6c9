"""Rank jobs' helpers (a free port, torchrun's environment) and a job for the
multi-process refusal tests: the mlp example, broken on purpose where
`JobConfig.options["fault"]` says, on every rank or on one (`options["fault_rank"]`).

`python -m cocoon_ckpt train --job tests.cocoon_ckpt.rank_jobs:build --job-option
fault=optimizer` runs it from the repository root.
"""

from __future__ import annotations

import os
import socket

import torch

from cocoon_ckpt import JobConfig
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts

__all__ = ["build", "free_port", "rank_env"]


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


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(
    base: dict[str, str], world: int, rank: int, port: str, crash_at: str | None = None
) -> dict[str, str]:
    """`base` with the environment torchrun gives rank `rank` of `world` (nothing added
    for one process), and the crash point `crash_at` armed (`COCOON_CRASH_AT`)."""
    env = dict(base)
    if world > 1:
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world)})
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
        env["LOCAL_WORLD_SIZE"] = str(world)
    if crash_at is not None:
        env["COCOON_CRASH_AT"] = crash_at
    return env
