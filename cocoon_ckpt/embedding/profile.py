"""Choose a table's path and hot threshold from a quick profile (Cocoon §4.2, Fig. 10-11).

Two unit costs are measured on scratch data in this process: one coordinate of online
BandMF for one step (fresh noise, history GEMV, ring write, update) and one coordinate
of an applied entry (index_add). A threshold h makes rows read more than h times hot;
the predicted step cost is then
    online * H(h) * dim + entry * dim * (cold reads) / n
against online * R * dim for the dense path. The cheapest h wins; when no h beats the
dense path by 10 %, the table stays dense (coalescing does not pay at small b).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cocoon_ckpt.dp.bandmf_noise import BandMFNoise
from cocoon_ckpt.dp.mechanism import BandMF
from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.embedding.one_thread import one_thread

__all__ = ["UnitCosts", "choose_threshold", "measure_unit_costs"]

#: Coalescing must beat the dense path by this factor to be chosen.
MARGIN = 0.9


@dataclass(frozen=True, slots=True)
class UnitCosts:
    online_s: float
    """Seconds per coordinate per step of online BandMF."""
    entry_s: float
    """Seconds per coordinate of an applied entry."""

    def to_record(self) -> dict[str, float]:
        return {"online_s": self.online_s, "entry_s": self.entry_s}


def _best(fn: Any, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_unit_costs(mechanism: BandMF, dim: int, dtype: torch.dtype, reps: int = 3) -> UnitCosts:
    """Time the online path and entry application on scratch data (about 0.1 s)."""
    width = 2 * BLOCK
    noise = BandMFNoise(mechanism, width, bytes(32), 1.0, dtype)
    param = torch.zeros(width, dtype=dtype)

    def online() -> None:
        w = noise.step()
        param.add_(w, alpha=-1e-3)

    for _ in range(min(mechanism.bands, 3)):
        online()  # warm the ring
    t_on = _best(online, reps) / width
    noise.close()
    rows = max(1, width // dim)
    table = torch.zeros(rows, dim, dtype=dtype)
    k = max(1, rows // 4)
    idx = torch.from_numpy(np.sort(np.random.default_rng(0).choice(rows, k, replace=False)))
    vals = torch.ones(k, dim, dtype=dtype)

    def apply() -> None:
        with one_thread():  # as `TableEngine.before_read` applies a column
            table.index_add_(0, idx, vals)

    t_e = _best(apply, reps) / (k * dim)
    return UnitCosts(online_s=t_on, entry_s=t_e)


def choose_threshold(
    counts: np.ndarray, steps: int, dim: int, costs: UnitCosts
) -> tuple[int | None, dict[str, Any]]:
    """The hot threshold with the lowest predicted step cost, or None for the dense path.

    Args:
        counts: (R,) reads per row over the run.
        steps: n.
        dim: embedding width.
        costs: measured unit costs.

    Returns:
        (threshold or None, a record of the prediction for the manifest).
    """
    rows = counts.size
    dense = costs.online_s * rows * dim
    desc = np.sort(counts)[::-1]
    cands = np.unique(np.concatenate([[0], counts, [int(counts.max(initial=0))]]))
    # reads of rows with count <= h: prefix sums over counts sorted ascending
    asc = desc[::-1]
    csum = np.concatenate([[0], np.cumsum(asc)])
    best_h, best_cost = 0, float("inf")
    for h in cands:
        cold_rows = int(np.searchsorted(asc, h, side="right"))
        hot = rows - cold_rows
        cost = costs.online_s * hot * dim + costs.entry_s * dim * float(csum[cold_rows]) / steps
        if cost < best_cost:
            best_h, best_cost = int(h), cost
    rec = {
        "unit_costs": costs.to_record(),
        "predicted_dense_s": dense,
        "predicted_coalesced_s": best_cost,
        "best_threshold": best_h,
    }
    if best_cost > MARGIN * dense:
        return None, rec
    return best_h, rec
