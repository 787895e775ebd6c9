from __future__ import annotations

import secrets

import pytest
import torch
from torch import nn

from cocoon_ckpt import DPConfig, DPTrainer, UnsupportedModelError
from cocoon_ckpt.train.runner import build_trainer

from .conftest import job_config

KEY = bytes(32)


def _train(example: str, seed: int, bands: int) -> dict[str, torch.Tensor]:
    tr = build_trainer(job_config(example, bands=bands, seed=seed, steps=10), KEY)
    while not tr.done:
        tr.train_step()
    return tr.model.state_dict()


@pytest.mark.parametrize("example", ["mlp", "dlrm"])
def test_same_seed_bit_identical_different_seed_differs(example: str) -> None:
    a, b = _train(example, 0, 4), _train(example, 0, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _train(example, 1, 4)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("bands", [1, 6])
def test_noise_overlapped_with_gradients_is_bit_identical(bands: int) -> None:
    """overlap_noise computes w_t in a thread during the per-sample gradients: the
    parameters and the ring end the same bit for bit."""
    import dataclasses

    cfg = job_config("mlp", bands=bands, steps=10)
    seq = build_trainer(cfg, KEY)
    ovl = build_trainer(dataclasses.replace(cfg, overlap_noise=True), KEY)
    assert ovl._noise_pool is not None and seq._noise_pool is None
    for tr in (seq, ovl):
        while not tr.done:
            tr.train_step()
    a, b = seq.model.state_dict(), ovl.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(seq.noise.ring, ovl.noise.ring)
    ovl.close()


def test_crash_in_the_noise_thread_reaches_the_caller() -> None:
    """A fault injected in the overlapped noise step is raised by train_step."""
    import dataclasses

    from fault_injection import CrashPointHit, crash_at, disarm_all

    tr = build_trainer(
        dataclasses.replace(job_config("mlp", bands=4, steps=6), overlap_noise=True), KEY
    )
    crash_at("noise.after_gemv", step=2)
    try:
        tr.train_step()
        tr.train_step()
        with pytest.raises(CrashPointHit, match="noise.after_gemv"):
            tr.train_step()
    finally:
        disarm_all()
        tr.close()


def test_clipping_bounds_each_example() -> None:
    tr = build_trainer(job_config("mlp", bands=1, steps=5), KEY)
    idx = torch.arange(40)
    summed, _ = tr.clipped_sum(idx)
    assert float(summed.norm()) <= 40 * tr.config.max_grad_norm + 1e-4
    one, _ = tr.clipped_sum(torch.tensor([3]))
    assert float(one.norm()) <= tr.config.max_grad_norm + 1e-5


def test_noise_reaches_the_gradient_exactly() -> None:
    # lr=1 SGD: the parameter change is -(clipped sum + w_t) / B exactly.
    cfg = job_config("mlp", bands=4, steps=4, lr=1.0)
    tr = build_trainer(cfg, KEY)
    before = torch.cat([p.detach().flatten().clone() for p in tr.model.parameters()])
    idx = torch.from_numpy(tr.sampler.batch(0))
    summed, _ = tr.clipped_sum(idx)
    w0 = tr.noise.fresh_noise.fresh(0) / float(tr.mechanism.coefficients[0])
    tr.train_step()
    after = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    assert torch.allclose(before - after, (summed + w0) / cfg.dp.batch_size, atol=1e-6)


def test_batchnorm_is_a_clear_error() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    data = (torch.randn(64, 4), torch.randint(0, 2, (64,)))
    cfg = DPConfig(steps=2, batch_size=8, dataset_size=64, noise_multiplier=1.0)
    with pytest.raises(UnsupportedModelError, match="BatchNorm1d.*GroupNorm"):
        DPTrainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.functional.cross_entropy,
            data,
            cfg,
            secrets.token_bytes(32),
        )


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"DPConfig.noise_multiplier=0"):
        DPConfig(steps=2, batch_size=8, dataset_size=64, noise_multiplier=0)
    with pytest.raises(ValueError, match=r"DPConfig.batch_size=40.*bands"):
        DPConfig(steps=4, batch_size=40, dataset_size=64, noise_multiplier=1, bands=2)
