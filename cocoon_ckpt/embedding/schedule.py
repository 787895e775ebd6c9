"""The access schedule of a table: which rows each step reads, known before step 0.

The sampler is a pure function of (seed, t), so batch(t) for every t, and with it the
rows of each table a step reads, can be enumerated up front (Cocoon §4.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["AccessSchedule", "table_schedule"]


@dataclass(frozen=True, slots=True)
class AccessSchedule:
    """Row reads of one table over n steps, in two sorted views.

    Attributes:
        rows: R, the table's row count.
        steps: n.
        step_ptr: (n+1,) int64; the rows step t reads are step_rows[step_ptr[t]:step_ptr[t+1]].
        step_rows: (E,) int64, sorted within each step, unique.
        row_ptr: (R+1,) int64; row r's read steps are row_steps[row_ptr[r]:row_ptr[r+1]].
        row_steps: (E,) int64, increasing per row.
        step_seq: (E,) int64, in step order: which read of its row each read is (0 first).
        step_prev: (E,) int64, in step order: the row's previous read step, or 0 if none
            (the start of the gap the read closes).
    """

    rows: int
    steps: int
    step_ptr: np.ndarray
    step_rows: np.ndarray
    row_ptr: np.ndarray
    row_steps: np.ndarray
    step_seq: np.ndarray
    step_prev: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        """(R,) reads per row over the whole run."""
        return np.diff(self.row_ptr)

    @property
    def events(self) -> int:
        """E, the number of (row, read) pairs."""
        return int(self.step_rows.size)

    def rows_at(self, t: int) -> np.ndarray:
        return self.step_rows[self.step_ptr[t] : self.step_ptr[t + 1]]

    def noise_order(self) -> np.ndarray:
        """(R,) the rows by reads, most read first, ties by row id: slot p of the table's
        noise space belongs to row order[p], so hot rows fill a prefix of noise blocks
        and their fresh noise is cheap to draw. A pure function of the schedule."""
        return np.lexsort((np.arange(self.rows), -self.counts)).astype(np.int64)

    @classmethod
    def from_step_rows(cls, rows: int, per_step: Sequence[np.ndarray]) -> AccessSchedule:
        """From the (possibly repeated, unsorted) row ids each step reads."""
        uniq = [np.unique(np.asarray(r, dtype=np.int64)) for r in per_step]
        for t, u in enumerate(uniq):
            if u.size and (u[0] < 0 or u[-1] >= rows):
                raise ValueError(
                    f"step {t} reads row {int(u[0] if u[0] < 0 else u[-1])} of a table with "
                    f"{rows} rows: ids must lie in [0, {rows})"
                )
        sizes = np.array([u.size for u in uniq], dtype=np.int64)
        step_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        step_rows = np.concatenate(uniq) if uniq else np.zeros(0, np.int64)
        step_of = np.repeat(np.arange(len(uniq), dtype=np.int64), sizes)
        order = np.lexsort((step_of, step_rows))
        row_steps = step_of[order]
        row_ptr = np.concatenate([[0], np.cumsum(np.bincount(step_rows, minlength=rows))]).astype(
            np.int64
        )
        row_of = step_rows[order]
        seq_row_order = np.arange(order.size, dtype=np.int64) - row_ptr[row_of]
        prev_row_order = np.where(
            seq_row_order > 0, np.concatenate([[0], row_steps[:-1]]), 0
        ).astype(np.int64)
        step_seq = np.empty_like(seq_row_order)
        step_prev = np.empty_like(prev_row_order)
        step_seq[order] = seq_row_order
        step_prev[order] = prev_row_order
        return cls(
            rows,
            len(uniq),
            step_ptr,
            step_rows.astype(np.int64),
            row_ptr,
            row_steps,
            step_seq,
            step_prev,
        )

    def tails(self) -> tuple[np.ndarray, np.ndarray]:
        """(seq, start) of every row's last gap, [last read (or 0), n): seq is the row's
        number of reads."""
        seq = self.counts.astype(np.int64)
        last = np.where(seq > 0, self.row_steps[np.maximum(self.row_ptr[:-1] + seq - 1, 0)], 0)
        return seq, last.astype(np.int64)


def table_schedule(ids: np.ndarray, batches: Sequence[np.ndarray], rows: int) -> AccessSchedule:
    """The schedule of a table whose id of example i is ids[i], for the given batches.

    Args:
        ids: (N,) int row ids, one per example.
        batches: batch(0), ..., batch(n-1): example indices per step.
        rows: R, the table's row count.
    """
    ids = np.asarray(ids, dtype=np.int64)
    return AccessSchedule.from_step_rows(rows, [ids[b] for b in batches])
