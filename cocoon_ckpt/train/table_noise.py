"""An embedding job's table noise as the trainer builds it: the tables' learning rates
read from the job's LR scheduler (`train.lr_schedule`), then `EmbeddingNoise`, whose lazy
draws the ranks of a torch.distributed job share (`embedding.lazy.RowShares`) and whose
coalesced tables' CSC they hold by parts (`embedding.csc_shards`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableMode
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.embedding.tables import EmbeddingNoise
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.tiers.config import TierConfig
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.lr_schedule import lr_schedule_ahead

__all__ = ["table_noise"]


def table_noise(
    embedding: EmbeddingConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    tensors: list[torch.Tensor],
    schedule: list[np.ndarray],
    mechanism: BandMF,
    noise_key: bytes,
    config: DPConfig,
    table_plans: dict[str, TablePlan] | None,
    table_tiers: TierConfig | None,
    ranks: DistContext | None = None,
) -> EmbeddingNoise:
    """The tables' noise; with a scheduler, its rates are the coalescer's lr_schedule.

    Args:
        ranks: the ranks of a torch.distributed job (None: one process): each lazy
            table's draws are split among them, each coalesced table's CSC is held by
            parts.

    Raises:
        ConfigError: `embedding.lr_schedule` is given and differs from the scheduler's
            rates, or the scheduler cannot be copied to read them ahead; with more than
            one rank, a table whose plan is dense (a resumed job's recorded plan).
    """
    if scheduler is not None:
        params = dict(model.named_parameters())
        rates = lr_schedule_ahead(
            optimizer, scheduler, [params[s.param] for s in embedding.tables], config.steps
        )
        if embedding.lr_schedule not in (None, rates):
            raise ConfigError(
                "EmbeddingConfig.lr_schedule differs from the rates JobParts.scheduler "
                "gives the tables: drop lr_schedule (it is read from the scheduler)"
            )
        embedding = dataclasses.replace(embedding, lr_schedule=rates)
    noise = EmbeddingNoise(
        embedding,
        model,
        optimizer,
        tensors,
        schedule,
        mechanism,
        noise_key,
        config.sigma * config.max_grad_norm,
        config.batch_size,
        table_plans,
        table_tiers,
    )
    if ranks is not None and ranks.world > 1:
        for e in noise.engines:
            if e.plan.mode is TableMode.DENSE:
                noise.close()
                raise ConfigError(
                    f"embedding table {e.spec.param!r} takes dense noise, which does not "
                    f"shard over {ranks.world} ranks: only lazy and coalesced noise "
                    "(threat_model='final_model') run on several ranks; run the job in "
                    "one process"
                )
            if e.lazy is not None:
                e.lazy.ranks = ranks
        try:
            noise.shard(ranks)
        except BaseException:
            noise.close()
            raise
    return noise
