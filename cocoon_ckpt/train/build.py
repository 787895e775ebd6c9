"""The trainer of a job: its parts built from the config, and what versions record
about it (threat model, model shapes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.layout import THREAT_MODEL_DEFAULT
from cocoon_ckpt.records import ModelShapes
from cocoon_ckpt.train.config import JobConfig
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.identity import check_config_optimizer
from cocoon_ckpt.train.mechanisms import Mechanism
from cocoon_ckpt.train.parts import JobParts, resolve
from cocoon_ckpt.train.trainer import DPTrainer

__all__ = ["build_trainer", "model_shapes", "threat_model"]


def build_trainer(
    config: JobConfig,
    key: bytes,
    builder: Callable[..., JobParts] | None = None,
    table_plans: dict[str, TablePlan] | None = None,
    dist: DistContext | None = None,
    mechanism: Mechanism | None = None,
) -> DPTrainer:
    """The trainer of a job (`table_plans`: the embedding plans a resume must keep;
    `mechanism`: the strategy a resume must keep, a stored BLT; None: built from the
    config).

    Raises:
        ValueError: the builder does not take (config) or does not return JobParts.
        ConfigError: the job's optimizer is not the one `config.optimizer`/`lr` name,
            or its dataset's size is not `config.dp.dataset_size`.
    """
    build = builder or resolve(config.job)
    try:
        parts = build(config)
    except TypeError as exc:
        if exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            # raised by the call itself, not inside the builder: a wrong signature
            raise ValueError(
                f"job {config.job!r}: the builder must be a function of one argument, the "
                f"JobConfig, returning JobParts ({exc})"
            ) from None
        raise
    if not isinstance(parts, JobParts):
        raise ValueError(
            f"job {config.job!r}: the builder returned {type(parts).__name__}, not JobParts"
        )
    check_config_optimizer(parts.optimizer, config.optimizer, config.lr, parts.scheduler)
    emb = config.embedding
    if emb is not None and not emb.tables:
        emb = dataclasses.replace(emb, tables=tuple(parts.tables))
    if parts.dataset is None:  # JobParts sets it; keeps the type exact
        raise ValueError(f"job {config.job!r}: JobParts has no dataset")
    return DPTrainer(
        parts.model,
        parts.optimizer,
        parts.loss_fn,
        parts.dataset,
        config.dp,
        key,
        mechanism=mechanism,
        tiers=config.tiers,
        embedding=emb,
        table_plans=table_plans,
        dist=dist,
        overlap_noise=config.overlap_noise,
        scheduler=parts.scheduler,
        stateful=parts.stateful,
        num_workers=parts.num_workers,
        pin_memory=parts.pin_memory,
        collate_fn=parts.collate_fn,
    )


def threat_model(config: JobConfig) -> str:
    """The threat model a job's versions carry (`layout.THREAT_MODELS`)."""
    return config.embedding.threat_model if config.embedding else THREAT_MODEL_DEFAULT


def model_shapes(trainer: DPTrainer) -> ModelShapes:
    """Each model state_dict entry's shape (the `model_shapes` record)."""
    return {k: list(v.shape) for k, v in trainer.model.state_dict().items()}
