"""bench/utility.py's datasets (shipped with scikit-learn, no download) and models.

Each dataset is split once, by a fixed permutation, into train / validation / test:
the learning rate is chosen on validation, accuracy is reported on test. Digits reuses
examples/digits/run.py's preprocessing (`Digits`: pixels / 16, float32) and its
`accuracy`; its model is that example's MLP (64-64-10, tanh).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from functools import cache
from types import ModuleType, SimpleNamespace

import numpy as np
import torch
from torch import nn

__all__ = ["SETTINGS", "Setting", "Split", "accuracy", "load", "make_model"]

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "digits" / "run.py"
#: The permutation that splits every dataset (fixed, so every run sees the same split).
_SPLIT_SEED = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """One dataset's training setting: the same for every method."""

    name: str
    """scikit-learn loader's short name."""
    train: int
    """Training examples N (the rest is halved into validation and test)."""
    batch: int
    """Expected batch size B."""
    steps: int
    """n training steps of a full run."""
    quick_steps: int
    """n under --quick."""
    hidden: int
    """Width of the MLP's hidden layer."""


#: digits: the issue's setting (1,200 training images, batch 20, 1,500 steps).
#: breast cancer: 380 of 569 for training (the rest 94 / 95), batch 20, 300 steps
#: (about 16 epochs): the setting tests/cocoon_ckpt/test_plan.py's plans are built on.
SETTINGS = {
    "digits": Setting(name="digits", train=1200, batch=20, steps=1500, quick_steps=300, hidden=64),
    "breast_cancer": Setting(
        name="breast_cancer", train=380, batch=20, steps=300, quick_steps=150, hidden=16
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Split:
    """Features (float32) and labels (int64) of train, validation and test."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def classes(self) -> int:
        return int(torch.cat([self.y_train, self.y_val, self.y_test]).max()) + 1


@cache
def _example() -> ModuleType:
    # examples/ is not a package: load the script as a module (its main() is guarded).
    spec = importlib.util.spec_from_file_location("_digits_example", _EXAMPLE)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"{_EXAMPLE}: the digits example is missing")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _features(name: str) -> tuple[np.ndarray, np.ndarray]:
    if name == "digits":
        ex = _example()
        # the example's two halves, in load_digits' order: all 1,797 images
        parts = [ex.Digits(train=True), ex.Digits(train=False)]
        x = torch.cat([p.x for p in parts]).numpy()
        y = torch.cat([p.y for p in parts]).numpy()
        return x, y
    if name == "breast_cancer":
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        return x, y
    raise ValueError(f"dataset {name!r}: expected one of {sorted(SETTINGS)}")


@cache
def load(name: str) -> Split:
    """The fixed split of dataset `name`. Breast cancer's features are standardised with
    the training part's mean and std (their scales differ by 10^4)."""
    setting = SETTINGS[name]
    x, y = _features(name)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
    n_val = (len(y) - setting.train) // 2
    tr, va, te = np.split(order, [setting.train, setting.train + n_val])
    if name == "breast_cancer":
        mean, std = x[tr].mean(axis=0), x[tr].std(axis=0)
        x = (x - mean) / std

    def part(i: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(x[i], dtype=torch.float32), torch.tensor(y[i], dtype=torch.int64)

    return Split(*part(tr), *part(va), *part(te))


def make_model(name: str, split: Split, seed: int) -> nn.Module:
    """The MLP of `name`, initialised from `seed` (the same initial model for every
    method at one seed)."""
    torch.manual_seed(seed)
    hidden = SETTINGS[name].hidden
    return nn.Sequential(
        nn.Linear(split.features, hidden), nn.Tanh(), nn.Linear(hidden, split.classes)
    )


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of `x` classified as `y` (the digits example's evaluation)."""

    # the example's accuracy() reads .x and .y of its Dataset
    return float(_example().accuracy(model, SimpleNamespace(x=x, y=y)))
