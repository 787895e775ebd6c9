"""The learning rate of every step, read from a job's LR scheduler ahead of time.

Coalesced embedding noise is precomputed with each step's learning rate
(`EmbeddingConfig.lr_schedule`), so a job with a scheduler needs the whole schedule
before step 0: a copy of the scheduler (sharing the parameters, copying the optimizer's
param_groups) is stepped through the job, and the real one is left untouched.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from cocoon_ckpt.errors import ConfigError

__all__ = ["lr_schedule_ahead"]


def lr_schedule_ahead(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    params: Sequence[torch.Tensor],
    steps: int,
) -> tuple[float, ...]:
    """The learning rate `params` get at each step 0..steps-1 under `scheduler`.

    Args:
        optimizer: the job's optimizer (as built: no step taken).
        scheduler: its LR scheduler, stepped once per step after the optimizer's.
        params: the parameters whose rate is wanted (the embedding tables); they must
            share one schedule.
        steps: n, the job's steps.

    Raises:
        ConfigError: the scheduler cannot be copied, or `params` lie in param groups
            whose schedules differ.
    """
    groups = [
        i
        for i, g in enumerate(optimizer.param_groups)
        if any(q is p for p in params for q in g["params"])
    ]
    # the parameters (and any tensor the optimizer shares with them) are not copied
    memo: dict[int, Any] = {id(q): q for g in optimizer.param_groups for q in g["params"]}
    try:
        ahead = copy.deepcopy(scheduler, memo)
    except Exception as exc:
        raise ConfigError(
            f"JobParts.scheduler {type(scheduler).__name__} cannot be copied ({exc}), so "
            "the embedding tables' learning rates cannot be read ahead for the coalesced "
            "noise: give EmbeddingConfig.lr_schedule (one rate per step) and no scheduler, "
            "or a scheduler that copy.deepcopy can copy"
        ) from None
    rates: list[list[float]] = []
    with warnings.catch_warnings():
        # the copy's optimizer never steps; torch warns about that order
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            rates.append([float(ahead.optimizer.param_groups[i]["lr"]) for i in groups])
            ahead.step()
    per_group = list(zip(*rates, strict=True)) if rates else []
    if any(g != per_group[0] for g in per_group):
        raise ConfigError(
            f"the embedding tables lie in param groups {groups} whose learning-rate "
            "schedules differ; coalesced noise takes one schedule: put the tables in one "
            "param group"
        )
    return tuple(float(x) for x in per_group[0]) if per_group else ()
