"""A trainer's warm-up (`train.warm.warm_kernels`) starts before the noise's ring is
made and is finished before the trainer is handed back, so it never runs beside a step:
its imports and kernel loads hold the GIL, which a step beside them waited for. No bit
of a job depends on it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from cocoon_ckpt import DPConfig
from cocoon_ckpt.train import trainer as trainer_module
from cocoon_ckpt.train import warm
from cocoon_ckpt.train.trainer import DPTrainer

KEY = bytes(range(32))


def _trainer(model: nn.Module, clipping: str = "ghost") -> DPTrainer:
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)]
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


class Watched(nn.Module):
    """An MLP whose forward records whether `thread` was alive when it ran."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1))
        self.thread = thread
        self.alive: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive.append(self.thread.is_alive())
        out: torch.Tensor = self.net(x)
        return out


class Gated(threading.Thread):
    """A warm-up that runs until someone waits for it: alive for as long as no one joins."""

    def __init__(self) -> None:
        self.release = threading.Event()
        super().__init__(target=self.release.wait, name="warm-kernels", daemon=True)

    def join(self, timeout: float | None = None) -> None:
        self.release.set()
        super().join(timeout)


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
def test_the_warm_up_begins_before_the_ring_and_ends_before_the_first_step(
    clipping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    gated = Gated()

    def warm_kernels(*a: Any, **kw: Any) -> threading.Thread:
        order.append("warm-up")
        gated.start()
        return gated

    built = trainer_module.build_noise

    def build_noise(*a: Any, **kw: Any) -> Any:
        order.append("ring")
        return built(*a, **kw)

    monkeypatch.setattr(trainer_module, "warm_kernels", warm_kernels)
    monkeypatch.setattr(trainer_module, "build_noise", build_noise)
    torch.manual_seed(0)
    model = Watched(gated)
    tr = _trainer(model, clipping)
    try:
        assert order == ["warm-up", "ring"]  # begun before the ring's first touch
        assert not gated.is_alive()  # waited for by the build
        tr.train_step()
        assert model.alive and not any(model.alive)  # never beside the model
    finally:
        gated.release.set()
        tr.close()


def test_a_trainer_waits_for_the_warm_up_of_its_kind_started_before() -> None:
    # a float32 job drawing with the default generator at the process's threads
    started = warm.warm_kernels("float32", ziggurat=True, threads=torch.get_num_threads())
    assert warm.warm_kernels("float32", ziggurat=True, threads=torch.get_num_threads()) is (started)
    torch.manual_seed(0)
    tr = _trainer(nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1)))
    try:
        assert not started.is_alive()
    finally:
        tr.close()


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
def test_bits_are_the_same_with_the_warm_up_off(
    clipping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        # above the compiled kernels' 2^20 elements: the step calls what was warmed
        model = nn.Sequential(nn.Linear(16, 1 << 16), nn.Tanh(), nn.Linear(1 << 16, 1))
        tr = _trainer(model, clipping)
        try:
            for _ in range(3):
                tr.train_step()
            return [p.detach().clone() for p in tr.model.parameters()]
        finally:
            tr.close()

    with_it = run()
    done = threading.Thread(target=lambda: None)  # a warm-up that warmed nothing
    done.start()
    done.join()
    monkeypatch.setattr(trainer_module, "warm_kernels", lambda *a, **kw: done)
    without = run()
    for a, b in zip(with_it, without, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
