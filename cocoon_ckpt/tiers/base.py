"""The tier contract: one shard of the noise history, computed where it lies.

A tier holds whole allocation units of the history, columns [start, stop) of every
ring slot, and offers the GEMV of a mixing vector over its shard, returning only the
partial result (its own columns). Public methods guard (capacity, allocation, shape);
subclasses implement the underscored ones, as torchtitan's checkpoint managers do.
"""

from __future__ import annotations

import concurrent.futures
import enum
import time
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from cocoon_ckpt.errors import CocoonError

__all__ = ["GemvMode", "Tier", "TierCapacityError", "TierError", "TierKind"]


class TierError(CocoonError, RuntimeError):
    """A tier failed (its worker died and could not be replaced, or it is closed)."""


class TierCapacityError(CocoonError, ValueError):
    """The tiers cannot hold the history (the message says how much is missing)."""


class TierKind(enum.Enum):
    """Where a shard lies; each kind computes its GEMV in place."""

    DEVICE = "device"
    """torch tensors on the compute device (CUDA when present, else the CPU)."""
    HOST = "host"
    """numpy arrays in host DRAM, GEMV in a host thread."""
    FAR = "far"
    """emulated CXL memory: a file-backed map owned by a worker process computing near it."""


class GemvMode(enum.Enum):
    """Where each step's history GEMV runs. Every mode gives bit-identical w (the kernel
    in `cocoon_ckpt.dp.gemv` has one order of rounding); they differ only in time."""

    NEAR_DATA = "near_data"
    """Each tier computes its shard where it lies, all at once; results merge (Cocoon)."""
    PULL_TO_DEVICE = "pull_to_device"
    """Baseline GPU-GEMV: every shard is pulled to the device, which computes all of it."""
    PULL_TO_HOST = "pull_to_host"
    """Baseline CPU-GEMV: every shard is pulled to the host, which computes all of it."""


class Tier(ABC):
    """One memory tier holding one shard of the ring history.

    Args:
        capacity: bytes this tier may use for history (and, for the device, the merge
            buffer).
    """

    kind: TierKind

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{type(self).__name__} capacity={capacity} must be >= 0 bytes")
        self.capacity = int(capacity)
        self.slots = 0
        self.width = 0
        self.dtype = np.dtype(np.float32)
        self.last_interval: tuple[float, float] | None = None
        """(start, end) perf_counter times of the last GEMV (the parallelism check)."""
        self._allocated = False
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"tier-{self.kind.value}"
        )

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def nbytes(self) -> int:
        """History bytes this tier holds."""
        return self.slots * self.width * self.dtype.itemsize

    def allocate(self, slots: int, width: int, dtype: np.dtype[Any] | str) -> None:
        """Hold (slots, width) zeros of `dtype`; refuse past the capacity."""
        self._check_open()
        dt = np.dtype(dtype)
        need = slots * width * dt.itemsize
        if need > self.capacity:
            raise TierCapacityError(
                f"{self.name} tier: a ({slots}, {width}) {dt} shard needs {need} bytes, the "
                f"capacity is {self.capacity} ({need - self.capacity} missing)"
            )
        self.slots, self.width, self.dtype = slots, width, dt
        self._allocate()
        self._allocated = True

    def write_slot(self, slot: int, values: np.ndarray) -> None:
        """Store `values` (width,) as ring slot `slot` of this shard."""
        self._check_slot(slot)
        if values.shape != (self.width,):
            raise ValueError(f"{self.name} tier: slot values {values.shape}, shard ({self.width},)")
        if self.width:
            self._write_slot(slot, np.ascontiguousarray(values, dtype=self.dtype))

    def read_slot(self, slot: int) -> np.ndarray:
        """A host copy of ring slot `slot` of this shard, (width,)."""
        self._check_slot(slot)
        if not self.width:
            return np.empty(0, dtype=self.dtype)
        return self._read_slot(slot)

    def read_slot_into(self, slot: int, out: np.ndarray) -> None:
        """Copy ring slot `slot` of this shard into `out`, a host array (width,)."""
        out[...] = self.read_slot(slot)

    def pull(self, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Columns [lo, hi) of every slot, (slots, hi - lo), copied to the host the way a
        baseline pulls them (across the link, for the far tier)."""
        self._check_open()
        hi = self.width if hi is None else hi
        if not 0 <= lo <= hi <= self.width:
            raise IndexError(f"{self.name} tier: columns [{lo}, {hi}) outside [0, {self.width})")
        if hi == lo or not self.slots:
            return np.zeros((self.slots, hi - lo), dtype=self.dtype)
        return self._pull(lo, hi)

    def submit_gemv(
        self, mix: np.ndarray, out: np.ndarray | None = None
    ) -> concurrent.futures.Future[np.ndarray]:
        """Start the GEMV of `mix` (slots,) over this shard where it lies; the future
        gives the (width,) partial result as a host array (`out` when given)."""
        self._check_open()
        if len(mix) != self.slots:
            raise ValueError(f"{self.name} tier: mixing vector of {len(mix)}, {self.slots} slots")
        return self._pool.submit(self._timed_gemv, np.asarray(mix), out)

    def profile(self, slots: int, width: int, dtype: np.dtype[Any] | str, reps: int = 3) -> float:
        """Median seconds of one GEMV over a scratch (slots, width) shard on this tier,
        allocated and freed here; the planner's profile."""
        self._check_open()
        times = self._profile(slots, width, np.dtype(dtype), max(1, reps))
        return float(np.median(times))

    def close(self) -> None:
        """Free the shard (and the worker). Idempotent."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._close()

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------
    def _timed_gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        t0 = time.perf_counter()
        if not self.width:
            h = np.empty(0, dtype=self.dtype) if out is None else out
        else:
            h = self._gemv(mix) if out is None else self._gemv_into(mix, out)
        self.last_interval = (t0, time.perf_counter())
        return h

    def _gemv_into(self, mix: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`_gemv` into `out` (width,); a tier that computes on the host overrides it to
        write there directly."""
        out[...] = self._gemv(mix)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise TierError(f"{self.name} tier is closed")

    def _check_slot(self, slot: int) -> None:
        self._check_open()
        if not self._allocated:
            raise TierError(f"{self.name} tier holds no shard yet: call allocate() first")
        if not 0 <= slot < self.slots:
            raise IndexError(f"{self.name} tier: slot {slot} outside [0, {self.slots})")

    # -- what a tier implements -----------------------------------------------------
    @abstractmethod
    def _allocate(self) -> None: ...

    @abstractmethod
    def _write_slot(self, slot: int, values: np.ndarray) -> None: ...

    @abstractmethod
    def _read_slot(self, slot: int) -> np.ndarray: ...

    @abstractmethod
    def _pull(self, lo: int, hi: int) -> np.ndarray: ...

    @abstractmethod
    def _gemv(self, mix: np.ndarray) -> np.ndarray: ...

    @abstractmethod
    def _profile(self, slots: int, width: int, dtype: np.dtype[Any], reps: int) -> list[float]: ...

    def _close(self) -> None:
        return None
