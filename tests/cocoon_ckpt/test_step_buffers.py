"""The DP step's kept buffers: w_t drawn into the trainer's buffer, the GEMV's h into the
noise's, a ghost clipped sum into the gradient buffer, and the one-pass elementwise
kernels. Each gives the bits of the fresh tensors and torch kernels it replaces (noise,
gradients, parameters), and the buffers are the same memory from step to step (no
fresh (dim,) pages a step)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from cocoon_ckpt import DPConfig
from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.elementwise import add_div_into, sub_div_
from cocoon_ckpt.dp.gemv import COMPILED_MIN_ELEMENTS, mix_history
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import KeyedNoise
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.tiers import DeviceTier, GemvMode, HostTier, TieredHistory
from cocoon_ckpt.train.ghost import GhostGrads
from cocoon_ckpt.train.trainer import DPTrainer

KEY = bytes(range(32))
U = 1 << 16  # a tier's allocation unit (one noise block)


def test_fresh_into_a_buffer_is_the_fresh_tensor() -> None:
    noise = KeyedNoise(KEY, 3 * U + 7, 0.5)
    out = torch.full((U + 9,), float("nan"))
    got = noise.fresh(4, U - 2, 2 * U + 7, out=out)
    assert got is out
    assert torch.equal(got, noise.fresh(4, U - 2, 2 * U + 7))
    with pytest.raises(ValueError, match=r"out is \(3,\) torch.float32"):
        noise.fresh(4, 0, 9, out=torch.empty(3))


@pytest.mark.parametrize("mode", [GemvMode.NEAR_DATA, GemvMode.PULL_TO_HOST])
def test_a_tiered_gemv_into_out_is_the_gemv(mode: GemvMode) -> None:
    rng = np.random.default_rng(0)
    ring = rng.standard_normal((3, 2 * U + 5)).astype(np.float32)
    mix = rng.standard_normal(3)
    tiers = [DeviceTier(1 << 30), HostTier(1 << 30)]
    h = TieredHistory(3, ring.shape[1], "float32", tiers, {"device": 1, "host": 2}, U, mode=mode)
    try:
        h.scatter(ring)
        out = np.full(ring.shape[1], np.nan, dtype=np.float32)
        assert h.gemv(mix, out) is out
        want = mix_history(mix, ring)
        assert np.array_equal(out, want) and np.array_equal(h.gemv(mix), want)
    finally:
        h.close()


def test_the_noise_step_into_a_buffer_repeats_the_fresh_steps() -> None:
    mech = BandMF.banded_sqrt(4, 20)
    width = 2 * U + 3
    kept = BandMFNoise(mech, width, KEY, 1.5)
    fresh = BandMFNoise(mech, width, KEY, 1.5, history=HostRing(3, width, "float32"))
    buf = torch.empty(width)
    h = None
    for _ in range(7):  # past b - 1: every ring slot written and read again
        w = kept.step(out=buf)
        assert w is buf and torch.equal(w, fresh.step())
        assert h is None or kept._h is h  # one h for every step
        h = kept._h
    assert np.array_equal(kept.history.gather(), fresh.history.gather())


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(self.emb(ids))).mean(1)


def _trainer(clipping: str, mechanism: str, overlap: bool, kept: bool) -> DPTrainer:
    torch.manual_seed(0)
    model = _Net()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 11, (64, 5), generator=g)
    y = torch.randint(0, 3, (64,), generator=g)
    cfg = DPConfig(
        steps=8,
        batch_size=8,
        dataset_size=64,
        noise_multiplier=0.7,
        bands=3,
        physical_batch_size=3,
        clipping=clipping,
        mechanism=mechanism,
        seed=2,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tr = DPTrainer(model, opt, nn.functional.cross_entropy, (x, y), cfg, KEY, overlap_noise=overlap)
    if not kept:  # the step as it was: fresh w_t, a fresh sum, fresh gradients
        step = tr.noise.step

        def fresh_step(out: Any = None) -> torch.Tensor:
            return step()

        tr.noise.step = fresh_step  # type: ignore[method-assign]
        tr._noisy.buffer = lambda dtype, device: None  # type: ignore[method-assign]
    return tr


@pytest.mark.parametrize(
    ("clipping", "mechanism", "overlap"),
    [("ghost", "banded_sqrt", False), ("ghost", "blt", True), ("vmap", "banded_sqrt", True)],
)
def test_a_step_with_kept_buffers_gives_the_fresh_steps_bits(
    clipping: str, mechanism: str, overlap: bool
) -> None:
    kept = _trainer(clipping, mechanism, overlap, kept=True)
    fresh = _trainer(clipping, mechanism, overlap, kept=False)
    try:
        grads: set[int] = set()
        for _ in range(5):
            a, b = kept.train_step(), fresh.train_step()
            assert (a.loss, a.grad_norm, a.noise_norm) == (b.loss, b.grad_norm, b.noise_norm)
            assert kept.last_noise is kept._w  # w_t in the kept buffer
            assert fresh.last_noise is not None and torch.equal(kept._w, fresh.last_noise)
            for p, q in zip(kept.model.parameters(), fresh.model.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None
                assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
            grads.add(next(kept.model.parameters()).grad.data_ptr())  # type: ignore[union-attr]
        assert len(grads) == 1  # the same gradient memory every step
        assert (
            kept.optimizer.state_dict()["state"].keys()
            == fresh.optimizer.state_dict()["state"].keys()
        )
        for s, t in zip(
            kept.optimizer.state_dict()["state"].values(),
            fresh.optimizer.state_dict()["state"].values(),
            strict=True,
        ):
            assert torch.equal(s["momentum_buffer"], t["momentum_buffer"])
    finally:
        kept.close()
        fresh.close()


def test_a_ghost_sum_into_a_buffer_is_the_sum() -> None:
    torch.manual_seed(0)
    model = _Net()
    names = [k for k, _ in model.named_parameters()]
    grads = GhostGrads(model, nn.functional.cross_entropy, names)
    batch = [torch.randint(0, 11, (6, 5)), torch.randint(0, 3, (6,))]
    want = grads.clipped_sum(batch, 0.5, 4)
    out = torch.full((grads.dim,), float("nan"))
    got = grads.clipped_sum(batch, 0.5, 4, out=out)
    assert got.summed is out and torch.equal(out, want.summed) and got.loss == want.loss
    with pytest.raises(ValueError, match="out is"):
        grads.clipped_sum(batch, 0.5, 4, out=torch.empty(3))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_one_pass_kernels_give_torchs_two_kernels_bits(dtype: Any) -> None:
    n = COMPILED_MIN_ELEMENTS + 77  # the compiled loop runs from here on
    rng = np.random.default_rng(3)
    z = torch.from_numpy((rng.standard_normal(n) * 3).astype(dtype))
    h = (rng.standard_normal(n) * 2).astype(dtype)
    special = [0.0, -0.0, float("inf"), float("nan"), 1e-40, -1e-38, 1e30]
    z[: len(special)] = torch.tensor(special, dtype=z.dtype)
    h[: len(special)] = [0.0, 0.0, 1.0, 2.0, 1e-40, 3e-39, -1e30]
    bits = torch.int32 if dtype == np.float32 else torch.int64
    for c0 in (1.0, 1.3, 0.7071067811865476, 1 / 3):
        want = (z - torch.from_numpy(h)) / c0
        got = z.clone()
        assert sub_div_(got, h, c0) is got
        assert torch.equal(got.view(bits), want.view(bits))
    w = torch.from_numpy(rng.standard_normal(n).astype(dtype))
    for b in (1, 3, 8, 1000):
        want = torch.add(z, w).div_(b)
        out = torch.empty_like(z)
        assert add_div_into(out, z, w, b) is out
        assert torch.equal(out.view(bits), want.view(bits))
        same = z.clone()  # the sum's own buffer as the output
        assert torch.equal(add_div_into(same, same, w, b).view(bits), want.view(bits))
