"""Coalesced noise entries in compressed sparse column form.

Column t holds the entries applied just before step t reads its rows; column n (the
last) holds the tails, applied when the final model is exported. An entry is one row's
whole pending noise update, -sum_s lr_s w_s[row] / B over the steps since the row's
previous read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CoalescedCSC"]


@dataclass(frozen=True, slots=True)
class CoalescedCSC:
    """Attributes:
    col_ptr: (n+2,) int64; column t is [col_ptr[t], col_ptr[t+1]); column n = tails.
    rows: (nnz,) int64 table row ids, increasing within a column.
    values: (nnz, dim) float32/float64, the parameter update of each entry.
    """

    col_ptr: np.ndarray
    rows: np.ndarray
    values: np.ndarray

    @property
    def steps(self) -> int:
        return int(self.col_ptr.size) - 2

    @property
    def nnz(self) -> int:
        return int(self.rows.size)

    @property
    def nbytes(self) -> int:
        return int(self.col_ptr.nbytes + self.rows.nbytes + self.values.nbytes)

    def column(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows, values) applied before step t (t = steps: the tails)."""
        lo, hi = int(self.col_ptr[t]), int(self.col_ptr[t + 1])
        return self.rows[lo:hi], self.values[lo:hi]

    @classmethod
    def from_entries(
        cls, steps: int, cols: np.ndarray, rows: np.ndarray, values: np.ndarray
    ) -> CoalescedCSC:
        """From unordered (column, row, value) triples; columns in [0, steps]."""
        order = np.lexsort((rows, cols))
        counts = np.bincount(cols, minlength=steps + 1)
        col_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(col_ptr, rows[order].astype(np.int64), np.ascontiguousarray(values[order]))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"col_ptr": self.col_ptr, "rows": self.rows, "values": self.values}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> CoalescedCSC:
        csc = cls(
            np.asarray(arrays["col_ptr"]), np.asarray(arrays["rows"]), np.asarray(arrays["values"])
        )
        ptr = csc.col_ptr
        if ptr.ndim != 1 or ptr[0] != 0 or np.any(np.diff(ptr) < 0) or ptr[-1] != csc.nnz:
            raise ValueError("CSC col_ptr is not a valid column pointer over the entries")
        if csc.values.shape[0] != csc.nnz:
            raise ValueError(f"CSC has {csc.nnz} rows but {csc.values.shape[0]} values")
        return csc
