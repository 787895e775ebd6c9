"""The kept gradient buffer made when a trainer is built and its pages faulted in off the
training thread (`train.warm.fault_in`, `NoisyGradients.reserve`): no byte is written
by the fault-in, the buffer is the one the steps then use, and a job's bits are the same
with it and without it, for ghost and vmap clipping."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from cocoon_ckpt import DPConfig
from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.train import noisy_grads, warm
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.trainer import DPTrainer

KEY = bytes(range(32))


def test_fault_in_writes_no_byte_even_beside_a_writer() -> None:
    buf = torch.arange(3 * warm.FAULT_IN_BYTES // 4, dtype=torch.float32)
    want = buf.clone()
    t = warm.fault_in([buf])
    assert t is not None and t.daemon
    # the caller writes while it runs: whichever faults a page in, the values are its own
    buf[::1024] = -1.0
    want[::1024] = -1.0
    t.join()
    assert torch.equal(buf.view(torch.int32), want.view(torch.int32))


def test_fault_in_skips_small_buffers() -> None:
    assert warm.fault_in([torch.empty(16)]) is None
    assert warm.fault_in([]) is None


def _trainer(clipping: str) -> DPTrainer:
    torch.manual_seed(0)
    # (512 + 1) x 640 dense parameters: a buffer above FAULT_IN_BYTES
    model = nn.Sequential(nn.Linear(512, 640), nn.Tanh(), nn.Linear(640, 1))
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 512, generator=g), torch.randn(64, 1, generator=g)]
    cfg = DPConfig(
        steps=6,
        batch_size=8,
        dataset_size=64,
        noise_multiplier=1.0,
        bands=3,
        physical_batch_size=3,
        clipping=clipping,  # type: ignore[arg-type]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return DPTrainer(model, opt, nn.functional.mse_loss, data, cfg, KEY)


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
def test_the_reserved_buffer_is_the_one_the_steps_use(clipping: str) -> None:
    tr = _trainer(clipping)
    try:
        flat = tr._noisy._flat
        assert flat is not None and flat.nbytes >= warm.FAULT_IN_BYTES
        assert tr._noisy.faulting is not None
        tr._noisy.faulting.join()
        for _ in range(2):
            tr.train_step()
            assert tr._noisy._flat is flat
            for p in tr.model.parameters():
                assert p.grad is not None and p.grad.untyped_storage().data_ptr() == (
                    flat.untyped_storage().data_ptr()
                )
    finally:
        tr.close()


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
def test_bits_are_the_same_with_and_without_the_fault_in(
    clipping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run() -> list[torch.Tensor]:
        tr = _trainer(clipping)
        try:
            for _ in range(4):
                tr.train_step()
            return [p.detach().clone() for p in tr.model.parameters()]
        finally:
            tr.close()

    with_it = run()
    monkeypatch.setattr(noisy_grads, "fault_in", lambda buffers: None)
    without = run()
    for a, b in zip(with_it, without, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_a_ghost_sum_into_a_dirty_buffer_is_the_sum_into_a_fresh_one() -> None:
    """The buffer is zeroed after the first chunk's backward, not at the call: what it
    held before (the last step's gradients, or nothing written yet) never shows."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    names = [k for k, _ in model.named_parameters()]
    ghost = GhostGrads(model, nn.functional.mse_loss, names)
    g = torch.Generator().manual_seed(2)
    batch = (torch.randn(7, 6, generator=g), torch.randn(7, 2, generator=g))
    fresh = ghost.clipped_sum(batch, 0.5, 3).summed
    dirty = torch.full((ghost.dim,), float("nan"))
    into = ghost.clipped_sum(batch, 0.5, 3, out=dirty).summed
    assert into is dirty
    assert torch.equal(fresh.view(torch.int32), into.view(torch.int32))


def test_the_warm_up_imports_what_the_first_vmap_imports() -> None:
    warm._warm(np.dtype(np.float64), False, 1)  # as its thread runs it
    assert warm.FIRST_VMAP_IMPORTS in sys.modules


def test_the_noise_steps_scratch_is_made_at_build_and_is_the_one_the_steps_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a step computes w_t in its ring slot from this width on, in parts of whole blocks
    monkeypatch.setattr(BandMFNoise, "slot_min_width", 1)
    monkeypatch.setattr(BandMFNoise, "slot_part_width", 3 * BLOCK)

    def run(reserve: bool) -> tuple[list[torch.Tensor], bool]:
        tr = _trainer("ghost")
        try:
            noise = tr.noise
            assert isinstance(noise, BandMFNoise)
            scratch = noise._chunk_h
            assert (scratch is not None) is reserve
            for _ in range(4):
                tr.train_step()
            same = noise._chunk_h is scratch
            return [p.detach().clone() for p in tr.model.parameters()], same
        finally:
            tr.close()

    with_it, same = run(True)
    assert same  # no step made another
    monkeypatch.setattr(BandMFNoise, "reserve_scratch", lambda self: None)
    without, _ = run(False)
    for a, b in zip(with_it, without, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
