"""Replayed tapes (train.traced_grads) give the eager vmap path's bits, or step aside.

The reference is the eager path itself (`trace_after=None`) on the same chunk sizes:
the claim is bit identity, not closeness.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from cocoon_ckpt import DPConfig
from cocoon_ckpt.errors import UnsupportedModelError
from cocoon_ckpt.train.grads import PerSampleGrads
from cocoon_ckpt.train.tape import MergeError, Op, Ref, Size, Tape, merge
from cocoon_ckpt.train.traced_grads import TracedChunk
from cocoon_ckpt.train.trainer import DPTrainer

ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Net(nn.Module):
    """A random MLP: optional frozen stem, a buffer, LayerNorm, a tied head."""

    def __init__(self, widths: list[int], act: str, frozen: bool, norm: bool, tied: bool) -> None:
        super().__init__()
        self.stem = nn.Linear(widths[0], widths[1])
        self.stem.requires_grad_(not frozen)
        self.register_buffer("shift", torch.linspace(-1, 1, widths[1]))
        layers: list[nn.Module] = []
        for a, b in zip(widths[1:-1], widths[2:], strict=True):
            layers += [ACTS[act](), nn.Linear(a, b)]
        if norm:
            layers.append(nn.LayerNorm(widths[-1]))
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], 3)
        self.tied = tied
        if tied:  # a second name for the head's weight
            self.alias = self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(self.stem(x) + self.shift)
        out: torch.Tensor = self.head(h)
        if self.tied:
            out = out + 0.5 * self.alias(h)
        return out


def _pair(model: nn.Module) -> tuple[PerSampleGrads, PerSampleGrads]:
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    loss = nn.functional.cross_entropy
    return (
        PerSampleGrads(model, loss, names, trace_after=None),
        PerSampleGrads(model, loss, names, trace_after=0),
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b)


@given(
    widths=st.lists(st.integers(1, 24), min_size=2, max_size=4),
    act=st.sampled_from(sorted(ACTS)),
    frozen=st.booleans(),
    norm=st.booleans(),
    tied=st.booleans(),
    double=st.booleans(),
    sizes=st.lists(st.integers(1, 30), min_size=3, max_size=6),
    chunk=st.sampled_from([None, 2, 5, 16]),
    clip=st.sampled_from([1e-3, 0.5, 10.0]),
    seed=st.integers(0, 2**16),
)
def test_replay_is_the_eager_path_bit_for_bit(
    widths: list[int],
    act: str,
    frozen: bool,
    norm: bool,
    tied: bool,
    double: bool,
    sizes: list[int],
    chunk: int | None,
    clip: float,
    seed: int,
) -> None:
    """Random models, dtypes, Poisson-like batch sizes, chunkings and clips: every
    clipped sum and loss equals the eager path's, and the replay did serve."""
    torch.manual_seed(seed)
    features = widths[0]
    model = Net([features, *widths], act, frozen, norm, tied)
    if double:
        model = model.double()
    eager, traced = _pair(model)
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    # the first sizes twice over: the replay serves them once recorded and checked
    for n in [*sizes, *sizes]:
        x = torch.randn(n, features, generator=g, dtype=dtype)
        y = torch.randint(0, 3, (n,), generator=g)
        want = eager.clipped_sum([x, y], clip, chunk)
        got = traced.clipped_sum([x, y], clip, chunk)
        assert _same(got.summed, want.summed)
        assert got.loss == want.loss or (got.loss != got.loss and want.loss != want.loss)
    fns = [f for f in traced._chunk_fns.values() if isinstance(f, TracedChunk)]
    assert fns and all(f.reason is None for f in fns)
    chunk_sizes = {m for n in sizes for m in _chunks(n, chunk)}
    if len(chunk_sizes) >= 2:
        assert any(f.replaying and f.checked for f in fns)


def _chunks(n: int, chunk: int | None) -> list[int]:
    step = n if chunk is None else chunk
    return [min(step, n - a) for a in range(0, n, step)]


def test_a_trainer_with_replay_takes_the_eager_trainers_steps() -> None:
    """Thirty DP steps (Poisson batches of varying size): the same parameters."""
    models = []
    for trace_after in (None, 0):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        g = torch.Generator().manual_seed(1)
        data = (torch.randn(300, 8, generator=g), torch.randint(0, 4, (300,), generator=g))
        cfg = DPConfig(steps=30, batch_size=12, dataset_size=300, noise_multiplier=1.0, bands=2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer = DPTrainer(model, opt, nn.functional.cross_entropy, data, cfg, bytes(32))
        trainer.grads.trace_after = trace_after
        for _ in range(30):
            trainer.train_step()
        trainer.close()
        if trace_after == 0:
            fns = list(trainer.grads._chunk_fns.values())
            assert any(isinstance(f, TracedChunk) and f.replaying for f in fns)
        models.append(model)
    for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(p, q)


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(self.drop(x))
        return out


class ReadsBuffer(nn.Module):
    """Reads a buffer's value in Python: a replay would keep the first value forever."""

    temperature: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("temperature", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) / float(self.temperature)
        return out


class Interaction(nn.Module):
    """Pairwise products of feature vectors, upper triangle picked by integer index
    tensors (DLRM's interaction): `z[:, rows, cols]` is `aten.index.Tensor`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 4 * 3)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.embed(x).view(-1, 4, 3)
        z = torch.bmm(v, v.transpose(1, 2))
        rows, cols = torch.triu_indices(4, 4, offset=1)
        out: torch.Tensor = self.head(z[:, rows, cols])
        return out


class Masked(nn.Module):
    """Picks features by a boolean mask: the output's shape counts the mask's Trues."""

    keep: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keep", torch.tensor([True, False, True, True, False, True]))
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x[:, self.keep])
        return out


def test_integer_indexing_is_replayed_with_the_eager_bits() -> None:
    eager, traced = _pair(Interaction())
    g = torch.Generator().manual_seed(0)
    for n in (5, 7, 5, 9, 7, 12):
        batch = [torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)]
        want, got = eager.clipped_sum(batch, 0.5), traced.clipped_sum(batch, 0.5)
        assert _same(got.summed, want.summed) and got.loss == want.loss
    (fn,) = traced._chunk_fns.values()
    assert isinstance(fn, TracedChunk) and fn.replaying and fn.reason is None
    assert fn.checked == {5, 7, 9, 12}


@pytest.mark.parametrize(
    ("model", "why"),
    [
        (Dropout(), "draws random numbers"),
        (ReadsBuffer(), "reads a tensor's value"),
        (Masked(), "shape depends on data"),
    ],
)
def test_what_cannot_be_replayed_runs_eagerly_with_a_logged_reason(
    model: nn.Module, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    eager, traced = _pair(model)
    g = torch.Generator().manual_seed(0)
    with caplog.at_level(logging.INFO, logger="cocoon_ckpt.train.traced_grads"):
        for n in (5, 7, 5, 9):
            batch = [torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)]
            torch.manual_seed(n)
            want = eager.clipped_sum(batch, 0.5)
            torch.manual_seed(n)
            got = traced.clipped_sum(batch, 0.5)
            assert _same(got.summed, want.summed) and got.loss == want.loss
            if isinstance(model, ReadsBuffer):
                model.temperature.add_(1.0)
    (fn,) = traced._chunk_fns.values()
    assert isinstance(fn, TracedChunk) and not fn.replaying and why in (fn.reason or "")
    assert any(why in r.getMessage() and "run eagerly" in r.getMessage() for r in caplog.records)


class InPlace(nn.Module):
    seen: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.sum(0))
        out: torch.Tensor = self.lin(x)
        return out


def test_models_torch_func_cannot_take_fail_the_same_way_while_recording() -> None:
    _, traced = _pair(InPlace())
    with pytest.raises(UnsupportedModelError, match="could not take per-sample gradients"):
        traced.clipped_sum([torch.randn(8, 4), torch.randint(0, 2, (8,))], 0.5, 3)


def test_a_replay_that_disagrees_is_retired_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    eager, traced = _pair(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)))
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> list[torch.Tensor]:
        return [torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)]

    for n in (4, 6):
        traced.clipped_sum(batch(n), 0.5)
    (fn,) = traced._chunk_fns.values()
    assert isinstance(fn, TracedChunk) and fn.replaying
    real = fn._replay
    assert real is not None
    fn._replay = lambda *a: (real(*a)[0] * 2, real(*a)[1])
    with caplog.at_level(logging.WARNING, logger="cocoon_ckpt.train.traced_grads"):
        b = batch(5)
        got, want = traced.clipped_sum(b, 0.5), eager.clipped_sum(b, 0.5)
    assert _same(got.summed, want.summed)  # the eager result, not the replay's
    assert not fn.replaying and "chunk size 5 was retired" in (fn.reason or "")
    assert any("bits differ" in r.getMessage() for r in caplog.records)


def _tape(n: int, shape: list[int], scale: float = 1.0) -> Tape:
    view = torch.ops.aten.view.default
    mul = torch.ops.aten.mul.Tensor
    ops = [
        Op(view, (Ref("in", 0), shape), {}, 1, None),
        Op(mul, (Ref("op", 0), scale), {}, 1, None),
    ]
    return Tape(ops, [], Ref("op", 1), n)


def test_merge_turns_the_size_into_n_and_refuses_anything_else() -> None:
    merged = merge(_tape(5, [5, 3, 15]), _tape(7, [7, 3, 21]))
    assert merged.ops[0].args[1] == [Size(1), 3, Size(3)]
    with pytest.raises(MergeError, match="is not c \\* n"):
        merge(_tape(5, [5, 4]), _tape(7, [7, 5]))
    with pytest.raises(MergeError, match="0.5"):
        merge(_tape(5, [5]), _tape(7, [7], scale=0.5))
    with pytest.raises(MergeError, match="both tapes are of size 5"):
        merge(_tape(5, [5]), _tape(5, [5]))


def test_a_size_whose_ops_differ_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    """A chunk function with a path special to n = 3: that size keeps the eager path,
    the others replay."""

    def chunk_fn(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per = (x * w).sum(dim=1)
        if x.shape[0] == 3:
            per = per * 1.0  # one more op
        return per.sum(dim=0, keepdim=True), per

    fn = TracedChunk(chunk_fn)
    w = torch.randn(4)
    with caplog.at_level(logging.INFO, logger="cocoon_ckpt.train.traced_grads"):
        for n in (4, 6, 3, 5, 3, 5, 4):
            x = torch.randn(n, 4)
            got, want = fn(w, x), chunk_fn(w, x)
            assert all(_same(u, v) for u, v in zip(got, want, strict=True))
    assert fn.replaying and fn.eager_sizes == {3} and fn.checked == {4, 5, 6}
    assert any("chunks of 3 run eagerly" in r.getMessage() for r in caplog.records)


def test_the_recorders_argument_walk_is_pytrees() -> None:
    """The recorder walks an op's arguments itself (faster); what it makes must be what
    `tree_map` / `tree_flatten` make, for every shape of argument aten passes and for
    containers it hands on to pytree."""
    from torch.utils._pytree import tree_flatten, tree_map

    from cocoon_ckpt.train.tape import Recorder, _leaves

    a, b, c = torch.zeros(2), torch.ones(3), torch.full((1,), 2.0)
    rec = Recorder([a, b])
    rec._ref(c)  # a constant
    cases = [
        (a, 1, [b, 2, None], (c, [a, (b,)]), torch.float32, torch.device("cpu")),
        [[a, b], [], ()],
        {"dim": [0, 1], "out": a, "dtype": torch.float64, "layout": torch.strided},
        (True, 1.5, "mean", None, torch.contiguous_format),
        ({"x": [a, (b, 3)]},),
    ]
    for args in cases:
        assert rec._template(args) == tree_map(rec._ref, args)
        want = [x for x in tree_flatten(args)[0] if isinstance(x, torch.Tensor)]
        got = [x for x in _leaves(args) if isinstance(x, torch.Tensor)]
        assert len(got) == len(want) and all(u is v for u, v in zip(got, want, strict=True))
