"""A job's training data as the trainer uses it: the dataset checked against the config,
and the batch of any step, through a DataLoader (`train.data`) or drawn in place."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.data import Batch, as_dataset, dataset_size, make_loader
from cocoon_ckpt.train.workers import DEFAULT_WORKER_TIMEOUT_S

__all__ = ["JobData"]

Select = Callable[[np.ndarray], np.ndarray]


class JobData:
    """The dataset of a job and how its batches are fetched.

    Args:
        data: a map-style Dataset of tuples (the last element is the target), or tensors
            indexed by example along dim 0 (`train.data.as_dataset`).
        dataset_size: N the config names; `len(data)` must equal it.
        needs_tensors: the job reads ids ahead of training (embedding noise), so the data
            must be tensors (a TensorDataset).
        num_workers, pin_memory, collate_fn: the DataLoader's options.
        worker_timeout_s: seconds a step waits for a worker's batch before the worker is
            named (`train.workers.WorkerWatch`).

    Raises:
        ConfigError: the sizes differ, or tensors are needed and the data is a Dataset.
    """

    def __init__(
        self,
        data: Dataset[Any] | Sequence[torch.Tensor],
        dataset_size_: int,
        *,
        needs_tensors: bool = False,
        num_workers: int = 0,
        pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
    ) -> None:
        self.dataset = as_dataset(data)
        self.size = dataset_size(self.dataset)
        if self.size != dataset_size_:
            raise ConfigError(
                f"config.dataset_size={dataset_size_} but the dataset holds len(dataset)="
                f"{self.size} examples: set DPConfig.dataset_size (--dataset-size) to "
                f"{self.size}"
            )
        if needs_tensors and not isinstance(self.dataset, TensorDataset):
            raise ConfigError(
                f"embedding noise needs the tables' ids ahead of training, but the data is "
                f"a {type(self.dataset).__name__}: give the job's data as tensors (or a "
                "TensorDataset), or drop EmbeddingConfig"
            )
        self.options: dict[str, Any] = {
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "collate_fn": collate_fn,
            "timeout_s": worker_timeout_s,
        }

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The data's tensors (a TensorDataset's; empty for any other Dataset)."""
        return list(self.dataset.tensors) if isinstance(self.dataset, TensorDataset) else []

    def loader(
        self, sampler: CyclicPoissonSampler, start: int, stop: int, select: Select | None
    ) -> DataLoader[Any]:
        """The batches of steps start, ..., stop - 1 (`train.data.make_loader`)."""
        return make_loader(
            self.dataset, sampler, start=start, steps=stop, select=select, **self.options
        )

    def draw(self, sampler: CyclicPoissonSampler, t: int, select: Select | None) -> Batch:
        """Step t's batch, the same bits `loader` gives (tensors: gathered in place,
        without a DataLoader's start-up)."""
        whole = sampler.batch(t)
        if isinstance(self.dataset, TensorDataset) and self.options["collate_fn"] is None:
            idx = torch.as_tensor(whole if select is None else select(whole), dtype=torch.int64)
            return Batch(t, idx, tuple(self.gather(idx)), len(whole))
        options = {**self.options, "num_workers": 0, "pin_memory": False}
        loader = make_loader(self.dataset, sampler, start=t, steps=t + 1, select=select, **options)
        return next(iter(loader))  # type: ignore[no-any-return]

    def gather(self, idx: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of examples `idx` (collated for a Dataset; `idx` non-empty)."""
        if isinstance(self.dataset, TensorDataset):
            return [d[idx] for d in self.dataset.tensors]
        collate = self.options["collate_fn"] or default_collate
        return list(collate([self.dataset[int(i)] for i in idx]))
