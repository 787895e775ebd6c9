"""A job as a user writes it, for the tests that kill it in real processes: a map-style
Dataset read by two DataLoader workers, SGD with momentum under StepLR, an EMA of the
weights that updates itself after every optimizer step, and (in the job's config) a
physical batch smaller than the logical one.

`python -m cocoon_ckpt train --job tests.cocoon_ckpt.real_job:build` runs it from the
repository root. `JobConfig.options["step_sleep"]` (seconds) slows each optimizer step
without changing any result, so a signal sent after a commit lands mid-run;
`options["worker_timeout_s"]` sets `JobParts.worker_timeout_s`.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt import JobConfig
from cocoon_ckpt.examples import mlp
from cocoon_ckpt.train.parts import JobParts
from cocoon_ckpt.train.workers import DEFAULT_WORKER_TIMEOUT_S

__all__ = ["EMA", "Pairs", "build"]


class Pairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A plain map-style Dataset over (x, y) tensors (not a TensorDataset)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class EMA:
    """An exponential moving average of a model's weights and the count of its updates."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.model, self.decay, self.count = model, decay, 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self) -> None:
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": dict(self.shadow), "count": self.count, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}
        self.count, self.decay = int(state["count"]), float(state["decay"])


def build(config: JobConfig) -> JobParts:
    """The mlp example's model and data, wrapped as a user's own job."""
    base = mlp.build(config)  # seeds torch
    # the checkpoint carries numpy's and Python's global generators too: seeded, they
    # are part of the result a resume must reproduce
    np.random.seed(config.dp.seed)
    random.seed(config.dp.seed)
    x, y = base.dataset  # type: ignore[misc]
    opt = torch.optim.SGD(base.model.parameters(), lr=config.lr, momentum=0.9)
    ema = EMA(base.model)
    sleep = float(config.options.get("step_sleep", 0.0))

    def after_step(*_: Any) -> None:
        ema.update()
        time.sleep(sleep)

    opt.register_step_post_hook(after_step)
    return JobParts(
        model=base.model,
        optimizer=opt,
        loss_fn=base.loss_fn,
        dataset=Pairs(x, y),
        scheduler=torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        stateful={"ema": ema},
        num_workers=2,
        worker_timeout_s=float(config.options.get("worker_timeout_s", DEFAULT_WORKER_TIMEOUT_S)),
    )
