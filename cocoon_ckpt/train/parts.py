"""What a job is: the parts a builder returns, and the loader for `example:NAME` or a user's `module:function`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from cocoon_ckpt.embedding.config import TableSpec

__all__ = ["JobParts", "resolve"]


@dataclass(frozen=True, slots=True)
class JobParts:
    """What a job builder returns: the model, its optimizer, loss and training data."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    data: Sequence[torch.Tensor]
    """Tensors indexed by example along dim 0; the last is the target."""
    tables: Sequence[TableSpec] = field(default_factory=tuple)
    """The model's embedding tables and where their ids are; used when the job config
    asks for embedding noise without naming tables."""


Builder = Callable[..., JobParts]


def resolve(job: str) -> Builder:
    """The builder for `example:mlp`, `example:dlrm`, or `package.module:function`.

    A builder is called as `builder(config)` with the JobConfig and returns JobParts.

    Raises:
        ValueError: the name is malformed or names nothing callable.
    """
    module, _, func = job.partition(":")
    if not module or not func:
        raise ValueError(f"job {job!r} must be 'example:NAME' or 'module:function'")
    if module == "example":
        module = f"cocoon_ckpt.examples.{func}"
        func = "build"
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"job {job!r}: cannot import module {module!r} ({exc})") from exc
    builder = getattr(mod, func, None)
    if not callable(builder):
        raise ValueError(f"job {job!r}: {module} has no callable {func!r}")
    return builder  # type: ignore[no-any-return]


def make_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """`sgd` or `adam` over `params`."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)
