from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from cocoon_ckpt.dp.sampler import CyclicPoissonSampler
from cocoon_ckpt.train.data import Batch, as_dataset, dataset_size, make_loader

N, STEPS = 96, 24


def _tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 3, 2, generator=g)
    ids = torch.randint(0, 50, (N, 4), generator=g)
    y = torch.randint(0, 5, (N,), generator=g)
    return x, ids, y


class Items(Dataset[tuple[torch.Tensor, ...]]):
    """A user's map-style Dataset over the same tensors, read one item at a time."""

    def __init__(self, tensors: tuple[torch.Tensor, ...], jitter: bool = False) -> None:
        self.tensors = tensors
        self.jitter = jitter

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, *rest = (t[i] for t in self.tensors)
        if self.jitter:  # a random augmentation from the global generators
            x = x + torch.randn(x.shape) + float(np.random.rand())
        return (x, *rest)


class NoLen(Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i


def _sampler(batch_size: int = 8, bands: int = 3) -> CyclicPoissonSampler:
    return CyclicPoissonSampler(dataset_size=N, batch_size=batch_size, bands=bands, seed=5)


def _same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        x.step == y.step
        and torch.equal(x.indices, y.indices)
        and len(x.tensors) == len(y.tensors)
        and all(
            s.dtype == t.dtype and s.shape == t.shape and torch.equal(s, t)
            for s, t in zip(x.tensors, y.tensors, strict=True)
        )
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("path", ["tensors", "dataset"])
def test_every_batch_is_the_samplers_batch_of_its_step(path: str) -> None:
    data = _tensors()
    sampler = _sampler()
    source: Any = data if path == "tensors" else Items(data)
    batches = list(make_loader(source, sampler, start=0, steps=STEPS))
    assert [b.step for b in batches] == list(range(STEPS))
    for t, b in enumerate(batches):
        idx = torch.from_numpy(sampler.batch(t))
        assert torch.equal(b.indices, idx)
        assert len(b) == b.logical_size == len(idx)
        assert all(torch.equal(got, d[idx]) for got, d in zip(b.tensors, data, strict=True))
        assert torch.equal(b.target, data[-1][idx]) and len(b.inputs) == 2


@pytest.mark.parametrize("start", [0, 1, 7, STEPS - 1, STEPS])
def test_start_at_t_gives_exactly_the_tail(start: int) -> None:
    data = Items(_tensors(), jitter=True)
    whole = list(make_loader(data, _sampler(), start=0, steps=STEPS))
    tail = list(make_loader(data, _sampler(), start=start, steps=STEPS))
    assert _same(tail, whole[start:])


def test_two_workers_give_the_batches_of_none() -> None:
    """Also with a random transform: each fetch is seeded from (seed, step), so neither
    the worker a batch lands on nor the step a resume starts at changes it."""
    data = Items(_tensors(), jitter=True)
    steps = 8
    inline = list(make_loader(data, _sampler(), start=0, steps=steps))
    workers = list(make_loader(data, _sampler(), start=0, steps=steps, num_workers=2))
    resumed = list(make_loader(data, _sampler(), start=3, steps=steps, num_workers=2))
    assert _same(workers, inline)
    assert _same(resumed, inline[3:])


def test_tensor_path_and_dataset_path_are_bit_identical() -> None:
    data = _tensors()
    fast = list(make_loader(data, _sampler(), start=0, steps=STEPS))
    items = list(make_loader(Items(data), _sampler(), start=0, steps=STEPS))
    torch_ds = list(
        make_loader(as_dataset(data), _sampler(), start=0, steps=STEPS, collate_fn=default_collate)
    )
    assert _same(fast, items) and _same(fast, torch_ds)


def _empty_steps(sampler: CyclicPoissonSampler, steps: int) -> list[int]:
    return [t for t in range(steps) if len(sampler.batch(t)) == 0]


@pytest.mark.parametrize("path", ["tensors", "dataset", "collate"])
def test_an_empty_batch_is_zero_length_tensors_of_the_trailing_shapes(path: str) -> None:
    data = _tensors()
    sampler = _sampler(batch_size=1, bands=1)  # p = 1/96: a third of the steps are empty
    empty = _empty_steps(sampler, 12)
    assert empty, "the seed must give an empty step"
    source: Any = data if path == "tensors" else Items(data)
    collate = (
        (lambda items: tuple(torch.stack(c) for c in zip(*items, strict=True)))
        if path == "collate"
        else None
    )
    batches = list(make_loader(source, sampler, start=0, steps=12, collate_fn=collate))
    for t in empty:
        b = batches[t]
        assert len(b) == 0 and b.indices.dtype == torch.int64
        assert [tuple(x.shape) for x in b.tensors] == [(0, 3, 2), (0, 4), (0,)]
        assert [x.dtype for x in b.tensors] == [d.dtype for d in data]


def test_the_loader_leaves_the_global_generators_alone() -> None:
    """Dropout draws from the global generator, so building or reading a loader (on
    resume, say) must not move it; nor may the per-fetch seeding."""
    expected = []
    for workers in (None, 0, 2):
        torch.manual_seed(11)
        np.random.seed(11)
        if workers is not None:
            loader = make_loader(
                Items(_tensors(), jitter=True), _sampler(), start=0, steps=4, num_workers=workers
            )
            list(loader)
        expected.append((torch.rand(3), np.random.rand()))
    assert all(torch.equal(t, expected[0][0]) and r == expected[0][1] for t, r in expected)


def test_select_keeps_a_share_and_records_the_logical_size() -> None:
    sampler = _sampler()
    halves = list(
        make_loader(
            _tensors(), sampler, start=0, steps=6, select=lambda idx: np.array_split(idx, 2)[1]
        )
    )
    for t, b in enumerate(halves):
        idx = sampler.batch(t)
        assert b.logical_size == len(idx)
        assert b.indices.tolist() == np.array_split(idx, 2)[1].tolist()


def test_refusals_name_the_problem() -> None:
    x, ids, y = _tensors()
    with pytest.raises(ValueError, match="dataset_size=96.*holds 95"):
        make_loader((x[:95], y[:95]), _sampler(), start=0, steps=2)
    with pytest.raises(ValueError, match="start=5 must lie in"):
        make_loader((x, y), _sampler(), start=5, steps=4)
    with pytest.raises(ValueError, match="disagree on the number of examples"):
        as_dataset((x, y[:10]))
    with pytest.raises(ValueError, match="at least one input tensor"):
        as_dataset((x,))
    with pytest.raises(TypeError, match="no len"):
        dataset_size(NoLen())
    loader = make_loader(
        Items((x, y)), _sampler(), start=0, steps=2, collate_fn=lambda items: {"x": items}
    )
    with pytest.raises(TypeError, match="must be a tuple of tensors"):
        next(iter(loader))
