"""NoisyGradients: the kept gradient buffer gives the bits (summed + w) / B gives, and
survives an optimizer's zero_grad."""

from __future__ import annotations

import torch
from torch import nn

from cocoon_ckpt.train.noisy_grads import NoisyGradients


def _model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def test_kept_buffer_gives_the_fresh_formulas_bits_every_step() -> None:
    model = _model()
    names = [k for k, _ in model.named_parameters()]
    noisy = NoisyGradients(model, names, batch_size=7)
    dim = sum(noisy.sizes)
    g = torch.Generator().manual_seed(1)
    first: list[torch.Tensor] = []
    for step in range(3):
        summed, w = torch.randn(dim, generator=g), torch.randn(dim, generator=g)
        noisy.set(summed, w)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        want = (summed + w) / 7
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        grads = [p.grad for p in model.parameters()]
        if step == 0:
            first = grads  # type: ignore[assignment]
        # the same tensors each step: nothing allocated per parameter
        assert all(a is b for a, b in zip(grads, first, strict=True))


def test_a_zero_grad_in_between_is_undone_by_the_next_set() -> None:
    model = _model()
    names = [k for k, _ in model.named_parameters()]
    noisy = NoisyGradients(model, names, batch_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dim = sum(noisy.sizes)
    noisy.set(torch.ones(dim), torch.zeros(dim))
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    noisy.set(torch.full((dim,), 3.0), torch.zeros(dim))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())  # type: ignore[arg-type]


def test_a_parameter_of_another_dtype_gets_a_fresh_gradient_in_its_dtype() -> None:
    model = _model()
    model[2].to(torch.float64)
    names = [k for k, _ in model.named_parameters()]
    noisy = NoisyGradients(model, names, batch_size=2)
    dim = sum(noisy.sizes)
    summed, w = torch.randn(dim, dtype=torch.float64), torch.randn(dim, dtype=torch.float32)
    noisy.set(summed, w)
    want = (summed + w.to(torch.float64)) / 2
    got = torch.split(want, noisy.sizes)
    for p, g in zip(model.parameters(), got, strict=True):
        assert p.grad is not None and p.grad.dtype == p.dtype
        assert torch.equal(p.grad, g.view(p.shape).to(p.dtype))
