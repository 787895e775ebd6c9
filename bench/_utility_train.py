"""bench/utility.py's single training runs: one (configuration, learning rate, seed).

A private run is the library's own training path, `DPTrainer` in process without a
store (nothing the bench measures depends on checkpoints): cyclic Poisson batches,
per-sample clipping at norm 1, the keyed correlated noise, plain SGD at a constant
learning rate (the optimizer `cocoon_ckpt.dp.plan` models). The non-private ceiling
and the Opacus reference train the same model for the same steps and batch size.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import torch
from _utility_data import SETTINGS, accuracy, load, make_model
from torch import nn

from cocoon_ckpt import BandMF, DPConfig, DPTrainer, MechanismKind

__all__ = ["Run", "train"]

#: Per-sample clipping norm of every private run.
CLIP = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One training run; `key()` names it in the results file."""

    dataset: str
    """A key of `_utility_data.SETTINGS`."""
    steps: int
    """n."""
    kind: str
    """"dp" (DPTrainer), "plain" (non-private SGD) or "opacus" (Opacus DP-SGD)."""
    epsilon: float | None
    """Target epsilon (None for plain)."""
    bands: int
    """b (1 for DP-SGD, plain and Opacus)."""
    mechanism: str | None
    """BandMF mechanism value (None for b = 1)."""
    sigma: float
    """Noise multiplier (0 for plain)."""
    lr: float
    """SGD learning rate."""
    seed: int
    """Model initialisation, sampler and noise-key seed."""

    def key(self) -> str:
        return (
            f"{self.dataset}|{self.steps}|{self.kind}|{self.epsilon}|{self.bands}|"
            f"{self.mechanism}|{self.sigma!r}|{self.lr!r}|{self.seed}"
        )


@functools.cache
def _mechanism(kind: str, bands: int, steps: int) -> BandMF:
    # optimized runs L-BFGS: built once per process, not once per run
    if MechanismKind(kind) is MechanismKind.OPTIMIZED:
        return BandMF.optimized(bands, steps)
    return BandMF.banded_sqrt(bands, steps)


def _noise_key(seed: int) -> bytes:
    return hashlib.blake2b(f"bench/utility seed {seed}".encode(), digest_size=32).digest()


def _train_dp(run: Run, model: nn.Module) -> None:
    split = load(run.dataset)
    mechanism = run.mechanism or MechanismKind.BANDED_SQRT.value  # b = 1: C = [1]
    config = DPConfig(
        steps=run.steps,
        batch_size=SETTINGS[run.dataset].batch,
        dataset_size=len(split.y_train),
        noise_multiplier=run.sigma,
        max_grad_norm=CLIP,
        bands=run.bands,
        mechanism=mechanism,
        seed=run.seed,
    )
    trainer = DPTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=run.lr),
        nn.functional.cross_entropy,
        (split.x_train, split.y_train),
        config,
        _noise_key(run.seed),
        mechanism=_mechanism(mechanism, run.bands, run.steps),
    )
    try:
        while not trainer.done:
            trainer.train_step()
    finally:
        trainer.close()


def _train_plain(run: Run, model: nn.Module) -> None:
    split = load(run.dataset)
    batch = SETTINGS[run.dataset].batch
    opt = torch.optim.SGD(model.parameters(), lr=run.lr)
    g = torch.Generator().manual_seed(run.seed)
    for _ in range(run.steps):
        idx = torch.randint(0, len(split.y_train), (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(split.x_train[idx]), split.y_train[idx]).backward()
        opt.step()


def _train_opacus(run: Run, model: nn.Module) -> None:
    from opacus import PrivacyEngine

    split = load(run.dataset)
    data = torch.utils.data.TensorDataset(split.x_train, split.y_train)
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=SETTINGS[run.dataset].batch,
        generator=torch.Generator().manual_seed(run.seed),
    )
    opt = torch.optim.SGD(model.parameters(), lr=run.lr)
    engine = PrivacyEngine()
    # make_private wraps `model` around the same parameters: train() evaluates the original
    # Poisson sampling at q = B / N (opacus' default); the same sigma as our DP-SGD row
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=run.sigma,
        max_grad_norm=CLIP,
    )
    step = 0
    while step < run.steps:
        for x, y in loader:
            if step == run.steps:
                break
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1


def train(run: Run) -> dict[str, float | str]:
    """Train `run` and return its validation and test accuracy (and its key)."""
    torch.set_num_threads(1)  # a 64-wide MLP: one thread is fastest, and the cores are shared
    split = load(run.dataset)
    model = make_model(run.dataset, split, run.seed)
    {"dp": _train_dp, "plain": _train_plain, "opacus": _train_opacus}[run.kind](run, model)
    return {
        "key": run.key(),
        "val": accuracy(model, split.x_val, split.y_val),
        "test": accuracy(model, split.x_test, split.y_test),
    }
