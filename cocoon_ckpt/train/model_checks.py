"""The refusals of a job's model and scheduler that need no key and no store: one
definition each, gathered in `checked_model`, which `DPTrainer` is built from and which a
start runs before anything is written (`train.build.check_parts`), so every rank refuses
a bad model alike."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cocoon_ckpt.dp.generator import NoiseRng, as_noise_rng
from cocoon_ckpt.embedding.config import EmbeddingConfig, TableSpec
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.config import DPConfig
from cocoon_ckpt.train.device import model_device
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.grads import PerSampleGrads

__all__ = [
    "CheckedModel",
    "check_noise_rng",
    "check_scheduler",
    "checked_model",
    "dense_param_names",
    "table_specs",
]


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


@dataclass(frozen=True, slots=True)
class CheckedModel:
    """What `checked_model` derived from a model it accepted: the trainer is built from it.

    Attributes:
        tables: the embedding tables whose gradients are taken per row.
        param_names: the dense trainable parameters, in the noise vector's order.
        grads: the clipped per-sample gradient sums (vmap, or ghost clipping).
        device: the one device the dense parameters lie on.
    """

    tables: tuple[TableSpec, ...]
    param_names: list[str]
    grads: PerSampleGrads | GhostGrads
    device: torch.device


def checked_model(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: DPConfig,
    embedding: EmbeddingConfig | None,
    scheduler: Any,
) -> CheckedModel:
    """Every refusal of `model` (and its scheduler) that needs no key, in one place:
    `DPTrainer` is built from what it returns, and `train.build.check_parts` runs it
    before a start writes anything, on every rank.

    Raises:
        ConfigError: the scheduler steps on a metric; embedding noise with no table
            named, or with a `noise_rng` other than default; the dense parameters lie
            on several devices.
        ValueError: a table is not a parameter.
        UnsupportedModelError: a BatchNorm in training mode, or trainable parameters
            not float32/float64; under `clipping="ghost"`, what `GhostGrads` refuses.
    """
    check_scheduler(scheduler)
    tables = table_specs(embedding)
    dense = dense_param_names(model, tables)
    grads = (GhostGrads if config.clipping == "ghost" else PerSampleGrads)(
        model, loss_fn, dense, tables=tables
    )
    device = model_device(model, dense)
    check_noise_rng(embedding, as_noise_rng(config.noise_rng))
    return CheckedModel(tables=tables, param_names=dense, grads=grads, device=device)


def check_scheduler(scheduler: Any) -> None:
    """Refuse an LR scheduler the DP step cannot step: one whose `step()` needs an argument
    (ReduceLROnPlateau's metric). The trainer steps it once per DP step with none, and has
    no private metric to give it: the training loss is computed from the private batch
    without noise, so a learning rate that follows it would leak the data outside the
    privacy accounting. Refused when the trainer is built, before anything is written.

    Raises:
        ConfigError: naming the scheduler, what its step needs and the fix.
    """
    if scheduler is None:
        return
    step = getattr(scheduler, "step", None)
    if not callable(step):
        raise ConfigError(
            f"the job's scheduler {type(scheduler).__name__} has no step(); give a "
            "torch.optim.lr_scheduler scheduler (or None)"
        )
    try:
        params = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = [p.name for p in params if p.kind in positional and p.default is p.empty]
    if needed:
        raise ConfigError(
            f"the job's scheduler {type(scheduler).__name__} steps on "
            f"{', '.join(needed)} (step({', '.join(needed)})), and a DP step has no private "
            "value to give it: the training loss comes from the private batch without "
            "noise, so a learning rate that follows it would leak the data outside the "
            "accounting; use a schedule fixed in advance (StepLR, CosineAnnealingLR, "
            "LambdaLR, ...)"
        )
