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
"""

from __future__ import annotations

import argparse
import os

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt import DPConfig, JobConfig, JobParts, export_model, open_job

TRAIN = 1437  # the first 80% of load_digits' fixed order; the rest is the test set
BATCH = 128  # the logical (Poisson) batch: what the privacy accounting sees
PHYSICAL = 32  # examples per per-sample-gradient chunk: what memory sees
LR = 0.5


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store", nargs="?", default="runs/digits.zarr")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="DataLoader worker processes")
    args = ap.parse_args()

    train, test = Digits(train=True), Digits(train=False)
    per_epoch = len(train) // BATCH
    torch.manual_seed(0)  # the same initial model on every run (a resume replaces it)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    parts = JobParts(
        model=model,
        optimizer=optimizer,
        loss_fn=nn.functional.cross_entropy,
        dataset=train,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2 * per_epoch, gamma=0.5),
        num_workers=args.workers,
    )
    dp = DPConfig(
        steps=args.epochs * per_epoch,
        batch_size=BATCH,
        physical_batch_size=PHYSICAL,
        dataset_size=len(train),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        bands=4,
    )
    config = JobConfig(job="examples.digits:run", dp=dp, lr=LR, checkpoint_every=per_epoch)
    key = args.store.rstrip("/") + ".key"
    os.makedirs(os.path.dirname(os.path.abspath(args.store)), exist_ok=True)
    with open_job(config, args.store, parts, key_file=key) as job:
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
