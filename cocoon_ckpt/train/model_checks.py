"""The refusals of a job's model that need no key and no store: one definition each,
run by `DPTrainer` when it is built and by a multi-process start before anything is
written (`train.build.check_parts`), so every rank refuses a bad model alike."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cocoon_ckpt.dp.generator import NoiseRng, as_noise_rng
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableSpec
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.device import model_device
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.grads import PerSampleGrads

__all__ = ["check_model", "check_noise_rng", "dense_param_names", "table_specs"]


def table_specs(embedding: EmbeddingConfig | None) -> tuple[TableSpec, ...]:
    """The embedding tables whose gradients are taken per row (none without embedding).

    Raises:
        ValueError: embedding noise is configured with no table named.
    """
    tables = tuple(embedding.tables) if embedding is not None else ()
    if embedding is not None and not tables:
        raise ConfigError(
            "embedding noise is configured but no table is named: list them in "
            "EmbeddingConfig.tables, or declare them in the job (JobParts.tables)"
        )
    return tables


def dense_param_names(model: nn.Module, tables: tuple[TableSpec, ...]) -> list[str]:
    """The dense trainable parameters, in the order of the flat clipped sum: every
    parameter that requires a gradient and is not a table."""
    names = {s.param for s in tables}
    return [k for k, p in model.named_parameters() if p.requires_grad and k not in names]


def check_noise_rng(embedding: EmbeddingConfig | None, noise_rng: NoiseRng) -> None:
    """Refuse a generator other than the default with embedding tables.

    Raises:
        ConfigError: embedding noise with a `noise_rng` other than default.
    """
    if embedding is not None and noise_rng is not NoiseRng.DEFAULT:
        raise ConfigError(
            f"DPConfig.noise_rng={noise_rng.value} with embedding tables: their "
            "noise is drawn by the default generator in this release; use "
            "noise_rng=default, or drop EmbeddingConfig"
        )


def check_model(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: DPConfig,
    embedding: EmbeddingConfig | None,
) -> None:
    """Everything `DPTrainer` refuses of `model` when built, without building it.

    Raises:
        ValueError: embedding noise with no table named; a table is not a parameter.
        UnsupportedModelError: a BatchNorm in training mode, or trainable parameters
            not float32/float64; under `clipping="ghost"`, what `GhostGrads` refuses.
        ConfigError: the dense parameters lie on several devices; embedding noise with
            a `noise_rng` other than default.
    """
    tables = table_specs(embedding)
    dense = dense_param_names(model, tables)
    # its refusals (ghost clipping's: tables, tied weights); nothing is taken
    (GhostGrads if config.clipping == "ghost" else PerSampleGrads)(
        model, loss_fn, dense, tables=tables
    )
    model_device(model, dense)
    check_noise_rng(embedding, as_noise_rng(config.noise_rng))
