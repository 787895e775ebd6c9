"""Cyclic Poisson sampling: every batch is a pure function of (seed, t).

The dataset is split once, by a seeded permutation, into b partitions; step t samples
partition t mod b, each example in independently with probability p = B b / N. An
example can then take part at most once every b steps (b-min-separation), which is
what lets b-banded MF be accounted as DP-SGD with q = B b / N for ceil(n / b) steps.
b = 1 is plain Poisson sampling over the whole dataset. Because `batch(t)` needs no
replay, the whole future access schedule can be enumerated and a resume needs no RNG
state beyond the seed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from cocoon_ckpt._state_dict import check_state

__all__ = ["CyclicPoissonSampler"]


def _philox(seed: int, purpose: int, t: int) -> np.random.Generator:
    digest = hashlib.blake2b(
        int(seed).to_bytes(16, "little", signed=True), digest_size=16, person=b"cocoon-sampler"
    ).digest()
    key = np.frombuffer(digest, dtype=np.uint64)
    # Draws advance counter word 0; words 1-2 hold (t, purpose), so streams never meet.
    return np.random.Generator(np.random.Philox(key=key, counter=[0, t, purpose, 0]))


class CyclicPoissonSampler:
    """Batches for b-banded training.

    Args:
        dataset_size: N examples.
        batch_size: B, the expected batch size.
        bands: b; the dataset is split into b partitions.
        seed: sampler seed.

    Raises:
        ValueError: an argument is out of range (named in the message).
    """

    def __init__(self, *, dataset_size: int, batch_size: int, bands: int, seed: int) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset_size={dataset_size} must be >= 1")
        if bands < 1:
            raise ValueError(f"bands={bands} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if batch_size * bands > dataset_size:
            raise ValueError(
                f"batch_size * bands = {batch_size} * {bands} exceeds dataset_size="
                f"{dataset_size}: each of the {bands} partitions must hold at least one "
                "expected batch; lower batch_size or bands"
            )
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.bands = bands
        self.seed = seed
        self.probability = batch_size * bands / dataset_size
        perm = _philox(seed, 0, 0).permutation(dataset_size)
        self.partitions = [np.sort(p) for p in np.array_split(perm, bands)]

    def batch(self, t: int) -> np.ndarray:
        """Sorted example indices of step t, int64 (may be empty)."""
        if t < 0:
            raise ValueError(f"step t={t} must be >= 0")
        part = self.partitions[t % self.bands]
        draws = _philox(self.seed, 1, t).random(len(part))
        return part[draws < self.probability].astype(np.int64)

    def schedule(self, steps: int) -> list[np.ndarray]:
        """batch(0), ..., batch(steps - 1): the whole access schedule."""
        return [self.batch(t) for t in range(steps)]

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "CyclicPoissonSampler",
            "schema_version": 1,
            "dataset_size": self.dataset_size,
            "batch_size": self.batch_size,
            "bands": self.bands,
            "seed": self.seed,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CyclicPoissonSampler:
        check_state(state, "CyclicPoissonSampler", 1)
        return cls(
            dataset_size=int(state["dataset_size"]),
            batch_size=int(state["batch_size"]),
            bands=int(state["bands"]),
            seed=int(state["seed"]),
        )
