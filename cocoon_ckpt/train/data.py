"""Batches of a DP job through a `torch.utils.data.DataLoader` driven by the cyclic
Poisson sampler.

The batch sampler yields the example indices of steps `start, ..., steps - 1`
(`CyclicPoissonSampler.batch(t)`), so a resume at step t replays nothing. Every batch
arrives as a `Batch`: the step, its indices and its tensors, with an empty Poisson batch
as zero-length tensors of the dataset's trailing shapes (never a special marker).

Two fetch paths give bit-identical tensors: a `TensorDataset` (today's in-memory
tensors) is gathered with one index per tensor, and any other map-style Dataset is read
item by item and collated (`default_collate` stacks, which copies the same bits).
Random transforms in a Dataset draw from torch's, numpy's and Python's global
generators; during a batch's fetch these are seeded from (seed, step) and restored
afterwards, so a batch is a pure function of (seed, step) whatever the number of
workers or the step a job resumed at.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.workers import DEFAULT_WORKER_TIMEOUT_S, WorkerInit, WorkerLoader

__all__ = [
    "Batch",
    "PoissonBatchSampler",
    "StepIndices",
    "as_dataset",
    "dataset_size",
    "make_loader",
]

#: a step's sorted indices -> the part this process trains on (e.g. a rank's share)
Select = Callable[[np.ndarray], np.ndarray]
Collate = Callable[[list[Any]], Any]


class StepIndices(list[int]):
    """The example indices of one step, carrying the step (pickles to workers with it).

    Attributes:
        step: the DP step t these indices belong to.
        logical_size: examples the step sampled before `select` kept this process's part.
    """

    def __init__(self, indices: Sequence[int], step: int, logical_size: int) -> None:
        super().__init__(indices)
        self.step = step
        self.logical_size = logical_size


class PoissonBatchSampler(Sampler[list[int]]):
    """The batches of steps `start, ..., steps - 1`, each `sampler.batch(t)` in order.

    Args:
        sampler: the job's cyclic Poisson sampler.
        start: the first step to yield (a resumed job's step; nothing earlier is drawn).
        steps: one past the last step (the job's total steps).
        select: keeps this process's part of each sorted batch (e.g.
            `DistContext.my_examples`); None keeps all of it.

    Raises:
        ValueError: start or steps out of range.
    """

    def __init__(
        self,
        sampler: CyclicPoissonSampler,
        *,
        start: int,
        steps: int,
        select: Select | None = None,
    ) -> None:
        if steps < 0:
            raise ValueError(f"steps={steps} must be >= 0")
        if not 0 <= start <= steps:
            raise ValueError(f"start={start} must lie in [0, steps={steps}]")
        self.sampler = sampler
        self.start = start
        self.steps = steps
        self.select = select

    def __iter__(self) -> Iterator[list[int]]:
        for t in range(self.start, self.steps):
            idx = self.sampler.batch(t)
            mine = idx if self.select is None else self.select(idx)
            yield StepIndices(mine.tolist(), t, len(idx))

    def __len__(self) -> int:
        return self.steps - self.start


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's examples.

    Attributes:
        step: the DP step t.
        indices: (n,) int64, the examples' indices in the dataset, sorted.
        tensors: the collated tensors, each (n, ...); the last is the target. An empty
            batch has n = 0 and the dataset's trailing shapes and dtypes.
        logical_size: examples the step sampled (n unless a `select` took a share).
    """

    step: int
    indices: torch.Tensor
    tensors: tuple[torch.Tensor, ...]
    logical_size: int

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        return self.tensors[:-1]

    @property
    def target(self) -> torch.Tensor:
        return self.tensors[-1]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Batch:
        """The batch with its tensors on `device` (indices stay where they are)."""
        moved = tuple(t.to(device, non_blocking=non_blocking) for t in self.tensors)
        return Batch(self.step, self.indices, moved, self.logical_size)

    def pin_memory(self) -> Batch:
        """Called by the DataLoader's pin-memory thread (`pin_memory=True`)."""
        pinned = tuple(t.pin_memory() for t in self.tensors)
        return Batch(self.step, self.indices.pin_memory(), pinned, self.logical_size)


def as_dataset(data: Dataset[Any] | Sequence[torch.Tensor]) -> Dataset[Any]:
    """A map-style Dataset for `data`: a Dataset as it is, tensors as a TensorDataset.

    Args:
        data: a map-style Dataset whose items are tuples (the last element is the
            target), or tensors indexed by example along dim 0 (the last is the target).

    Raises:
        ValueError: the tensors are fewer than two or disagree on the number of examples.
        TypeError: the Dataset has no `len()`.
    """
    if isinstance(data, Dataset):
        if isinstance(data, TensorDataset):
            _check_tensors(data.tensors)
        dataset_size(data)
        return data
    tensors = tuple(data)
    _check_tensors(tensors)
    return TensorDataset(*tensors)


def _check_tensors(data: Sequence[torch.Tensor]) -> None:
    if len(data) < 2:
        raise ValueError("data must hold at least one input tensor and the target tensor")
    n = int(data[0].shape[0])
    if any(int(d.shape[0]) != n for d in data):
        raise ValueError(
            f"data tensors disagree on the number of examples: {[d.shape[0] for d in data]}"
        )


def dataset_size(dataset: Dataset[Any]) -> int:
    """N, the number of examples: `len(dataset)`.

    Raises:
        TypeError: the Dataset has no `__len__` (name the size with --dataset-size).
    """
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError as exc:
        raise TypeError(
            f"dataset {type(dataset).__name__} has no len(): define __len__ on it (a "
            "map-style Dataset), or give the size with --dataset-size"
        ) from exc


@dataclass(frozen=True, slots=True)
class _Fetched:
    """What a worker read for one step, handed to `_Collate` in the same process."""

    step: int
    indices: list[int]
    logical_size: int
    items: list[Any]
    """Dataset items; [item 0] (a template for the shapes) when the batch is empty."""
    gathered: tuple[torch.Tensor, ...] | None
    """The TensorDataset fast path: the batch already gathered, items unused."""


class _Indexed(Dataset[Any]):
    """Wraps the user's Dataset so a fetch sees its step (batched `__getitems__`)."""

    def __init__(self, dataset: Dataset[Any], seed: int, fast: bool) -> None:
        self.dataset = dataset
        self.seed = seed
        self.fast = fast

    def __len__(self) -> int:
        return dataset_size(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, indices: list[int]) -> _Fetched:
        step = getattr(indices, "step", None)
        if step is None:
            raise TypeError(
                "the loader's batch sampler must be a PoissonBatchSampler (its batches "
                "carry their step): build the loader with make_loader"
            )
        logical = int(getattr(indices, "logical_size", len(indices)))
        if self.fast and isinstance(self.dataset, TensorDataset):
            idx = torch.tensor(indices, dtype=torch.int64)
            gathered = tuple(d[idx] for d in self.dataset.tensors)
            return _Fetched(step, list(indices), logical, [], gathered)
        with _seeded(self.seed, step):
            if not indices:
                items = [self.dataset[0]]
            elif hasattr(self.dataset, "__getitems__"):
                items = list(self.dataset.__getitems__(list(indices)))
            else:
                items = [self.dataset[i] for i in indices]
        return _Fetched(step, list(indices), logical, items, None)


class _Collate:
    """Turns a `_Fetched` into a `Batch` with the user's collate (picklable to workers)."""

    def __init__(self, collate_fn: Collate | None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, fetched: Any) -> Batch:
        if not isinstance(fetched, _Fetched):
            raise TypeError(
                f"the loader's dataset must be make_loader's wrapper (it fetched a "
                f"{type(fetched).__name__}): build the loader with make_loader"
            )
        idx = torch.tensor(fetched.indices, dtype=torch.int64)
        if fetched.gathered is not None:
            return Batch(fetched.step, idx, fetched.gathered, fetched.logical_size)
        collate = self.collate_fn if self.collate_fn is not None else default_collate
        out = collate(fetched.items)
        if not isinstance(out, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in out):
            raise TypeError(
                f"step {fetched.step}: the collated batch must be a tuple of tensors (inputs, "
                f"then the target), got {type(out).__name__}: make the Dataset's items "
                "tuples of tensors, or return a tuple of tensors from collate_fn"
            )
        tensors = tuple(out)
        if not fetched.indices:
            # the shapes come from item 0; the batch holds none of it
            tensors = tuple(t[:0] for t in tensors)
        n = len(fetched.indices)
        if any(int(t.shape[0]) != n for t in tensors):
            raise ValueError(
                f"step {fetched.step}: collated tensors have {[t.shape[0] for t in tensors]} "
                f"rows for {n} examples: collate_fn must stack the items along dim 0"
            )
        return Batch(fetched.step, idx, tensors, fetched.logical_size)


@contextmanager
def _seeded(seed: int, step: int) -> Iterator[None]:
    """torch's CPU, numpy's and Python's global generators seeded from (seed, step)
    inside, restored after (the main process's streams are not disturbed)."""
    digest = hashlib.blake2b(
        f"{seed}:{step}".encode(), digest_size=8, person=b"cocoon-fetch"
    ).digest()
    value = int.from_bytes(digest, "little") >> 1
    torch_state = torch.default_generator.get_state()
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        # the CPU generator only: torch.manual_seed also seeds every accelerator (ms)
        torch.default_generator.manual_seed(value)
        np.random.seed(value % 2**32)
        random.seed(value)
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        np.random.set_state(np_state)
        random.setstate(py_state)


def make_loader(
    dataset: Dataset[Any] | Sequence[torch.Tensor],
    sampler: CyclicPoissonSampler,
    *,
    start: int,
    steps: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    collate_fn: Collate | None = None,
    select: Select | None = None,
    worker_init_fn: Callable[[int], None] | None = None,
    timeout_s: float = DEFAULT_WORKER_TIMEOUT_S,
) -> DataLoader[Any]:
    """A DataLoader yielding one `Batch` per step `start, ..., steps - 1`.

    Args:
        dataset: a map-style Dataset of tuples (the last element is the target), or
            tensors indexed by example along dim 0.
        sampler: the job's sampler; its dataset_size must equal `len(dataset)`.
        start: the first step (a resume's step: earlier batches are not drawn).
        steps: one past the last step.
        num_workers: DataLoader worker processes (0: fetch in this process).
        pin_memory: pin each batch's tensors (for a copy to an accelerator).
        collate_fn: turns a list of items into a tuple of tensors, each (n, ...);
            `default_collate` when None. It is also called on [item 0] to give an empty
            batch its trailing shapes.
        select: keeps this process's part of each batch (see PoissonBatchSampler).
        worker_init_fn: called in each worker as `worker_init_fn(worker_id)`, after the
            worker has set SIGTERM and SIGINT to SIG_IGN (a signal to the process group
            stops the job through the main process alone).
        timeout_s: seconds a step waits for a worker's batch before
            `train.workers.WorkerWatch` names the worker and ends the workers.

    Returns:
        The loader; the global torch generator is not consumed by it (the workers' base
        seed comes from a generator of its own), so a resume draws the same dropout.

    Raises:
        ValueError: the dataset's size differs from the sampler's, or start/steps are out
            of range.
    """
    data = as_dataset(dataset)
    n = dataset_size(data)
    if n != sampler.dataset_size:
        raise ConfigError(
            f"the sampler draws from dataset_size={sampler.dataset_size} examples but the "
            f"dataset holds {n}: set DPConfig.dataset_size to len(dataset)"
        )
    batches = PoissonBatchSampler(sampler, start=start, steps=steps, select=select)
    # the workers' base seed is drawn from this generator, not the global one: a loader
    # built on resume must not shift the model's random stream (dropout). Fetches reseed
    # per step (_seeded), so the base seed itself changes no batch.
    generator = torch.Generator().manual_seed(0)
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ConfigError(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    return WorkerLoader(
        _Indexed(data, sampler.seed, fast=collate_fn is None),
        batch_sampler=batches,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=_Collate(collate_fn),
        generator=generator,
        worker_init_fn=WorkerInit(worker_init_fn) if num_workers > 0 else None,
        worker_timeout_s=timeout_s,
    )
