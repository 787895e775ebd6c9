"""scikit-learn's handwritten digits, trained privately in your own loop.

    pip install -e ".[examples]"
    python examples/digits/run.py [STORE] [--epochs N]   (default runs/digits.zarr, 4)

The 1,797 8x8 images (shipped with scikit-learn, no download) are a map-style
Dataset; the job's DataLoader draws each step's Poisson batch (expected 128 examples)
and the per-sample gradients are taken 32 at a time (the physical batch). A StepLR
halves the learning rate every two epochs; the test accuracy is printed after each
epoch. Kill it at any moment and run it again: it resumes from the newest version and
ends with the same model bit for bit. The model and its privacy report are exported
once every step is taken.

Its parts import (`examples/` is not a package: run from the repository root): `Digits`,
`make_model`, `make_parts`, `make_config`, and `build`, the job builder the CLI takes:

    cocoon-ckpt train --job examples.digits.run:build --store runs/d.zarr --steps 44 \
        --batch-size 128 --physical-batch-size 32 --dataset-size 1437 --lr 0.5 --bands 4
"""

from __future__ import annotations

import argparse
import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt import DPConfig, JobConfig, JobOptions, JobParts, export_model, open_job

TRAIN = 1437  # the first 80% of load_digits' fixed order; the rest is the test set
BATCH = 128  # the logical (Poisson) batch: what the privacy accounting sees
PHYSICAL = 32  # examples per per-sample-gradient chunk: what memory sees
LR = 0.5
PER_EPOCH = TRAIN // BATCH  # steps per epoch


class Digits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """load_digits as (image (64,) float32 in [0, 1], label int64) pairs."""

    def __init__(self, train: bool) -> None:
        x, y = load_digits(return_X_y=True)
        part = slice(0, TRAIN) if train else slice(TRAIN, None)
        self.x = torch.tensor(x[part] / 16.0, dtype=torch.float32)
        self.y = torch.tensor(y[part], dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def accuracy(model: nn.Module, data: Digits) -> float:
    """Test accuracy; draws no random numbers, so it changes nothing a resume replays."""
    with torch.no_grad():
        return float((model(data.x).argmax(dim=1) == data.y).float().mean())


def make_model() -> nn.Module:
    """The MLP (64-64-10, tanh), initialised from torch's seed 0: the same initial model
    on every run (a resume replaces it). Reseeds torch's global generator."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def make_parts(workers: int = 1) -> JobParts:
    """The job's parts: the model, SGD at `LR` halved every two epochs by a StepLR, and
    the training images as a map-style Dataset (`workers` DataLoader processes)."""
    train = Digits(train=True)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return JobParts(
        model=model,
        optimizer=optimizer,
        loss_fn=nn.functional.cross_entropy,
        dataset=train,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2 * PER_EPOCH, gamma=0.5),
        num_workers=workers,
    )


def make_config(epochs: int) -> JobConfig:
    """The job this script runs: `epochs` epochs of `PER_EPOCH` Poisson batches, a
    checkpoint after each."""
    dp = DPConfig(
        steps=epochs * PER_EPOCH,
        batch_size=BATCH,
        physical_batch_size=PHYSICAL,
        dataset_size=TRAIN,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        bands=4,
    )
    # the name stores written by this script record (a resume compares it)
    return JobConfig(job="examples.digits:run", dp=dp, lr=LR, checkpoint_every=PER_EPOCH)


def build(config: JobConfig) -> JobParts:
    """The job builder (`--job examples.digits.run:build`): `make_parts`, its DataLoader
    workers from `config.options["workers"]` (default 0, in the training process)."""
    return make_parts(int(config.options.get("workers", 0)))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", default="runs/digits.zarr")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    args = ap.parse_args()

    test = Digits(train=False)
    per_epoch = PER_EPOCH
    parts = make_parts(args.workers)
    config = make_config(args.epochs)
    dp = config.dp
    key = args.store.rstrip("/") + ".key"
    os.makedirs(os.path.dirname(os.path.abspath(args.store)), exist_ok=True)
    with open_job(config, args.store, parts, options=JobOptions(key_file=key)) as job:
        if job.resumed_from is not None:
            print(f"resumed at step {job.resumed_from}")
        for step in job.steps():
            if job.step % per_epoch == 0:
                print(
                    f"epoch {job.step // per_epoch}: loss {step.loss:.3f}, test accuracy "
                    f"{accuracy(job.model, test):.3f}, epsilon {job.epsilon():.2f}"
                )
    out = args.store.rstrip("/") + ".pt"
    if job.done and not os.path.exists(out):
        report = export_model(args.store, out)
        print(f"exported {out} (epsilon {report['epsilon']:.2f} at delta {dp.delta:g})")


if __name__ == "__main__":
    main()
