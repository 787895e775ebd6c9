"""Where the correlated noise keeps its last b-1 outputs: the `RingHistory` contract and
`HostRing`, the plain one-array host ring.

The math (`cocoon_ckpt.dp.noise`) defines what it needs of a history and the tiers
(`cocoon_ckpt.tiers.history.TieredHistory`) implement it, so `dp` never imports
`tiers`. Any implementation's `gemv` must compute the sum of `cocoon_ckpt.dp.gemv` in its
one fixed order of rounding: then the noise is bit-identical whatever holds the ring.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from cocoon_ckpt.dp.gemv import mix_history

__all__ = ["HostRing", "InPlaceRing", "RingHistory", "load_ring_into", "shard_ring"]


@runtime_checkable
class RingHistory(Protocol):
    """A (slots, width) ring of past outputs w_t, slot t mod slots holding step t.

    Guarantee: `gemv(mix)` returns sum_i mix[i] * ring[i] per coordinate, each product
    and addition rounded on its own in the order i = 0..slots-1 (`dp.gemv`), so two
    histories holding the same values give the same bits; `write` then `read` of a slot
    returns the values written, cast to `dtype`.
    """

    slots: int
    """b - 1 ring slots (0 for DP-SGD)."""
    width: int
    """Columns (coordinates) in all."""
    dtype: np.dtype[Any]
    """float32 or float64."""
    plan: dict[str, Any] | None
    """The placement plan record a checkpoint keeps (None when nothing was planned)."""

    @property
    def nbytes(self) -> int:
        """History bytes held."""
        ...

    def placement(self) -> list[dict[str, Any]]:
        """Which columns lie where: `{"tier", "start", "stop"}` records (the manifest's
        `noise.placement`)."""
        ...

    def write(self, slot: int, w: np.ndarray) -> None:
        """Store w (width,) as ring slot `slot`."""
        ...

    def read(self, slot: int, out: np.ndarray | None = None) -> np.ndarray:
        """A host copy of ring slot `slot`, (width,): into `out` when given (a
        checkpoint copies straight into its snapshot, no temporary), which is returned."""
        ...

    def gather(self) -> np.ndarray:
        """A host copy of the whole ring, (slots, width)."""
        ...

    def scatter(self, ring: np.ndarray) -> None:
        """Load a whole ring, (slots, width)."""
        ...

    def gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """h = sum_i mix[i] ring[i], (width,) on the host; mix is (slots,), rotated to
        the ring's slots. Into `out` when given, a (width,) host array of `dtype` (a
        step's kept scratch: no fresh pages a step), which is returned."""
        ...

    def close(self) -> None:
        """Free what the history holds. Idempotent."""
        ...


@runtime_checkable
class InPlaceRing(Protocol):
    """A ring held as one host array that a step may write a slot of in place
    (`HostRing`; `tiers.TieredHistory` with every column on one host tier): the BandMF
    step then computes w_t in the slot itself, with no (width,) buffer of its own."""

    def open_slot(self, slot: int) -> np.ndarray | None:
        """The whole ring, a writable (slots, width) host array, once every write guard
        has run for `slot` (a snapshot's lent row of it copied out or finished): the
        caller then writes slot `slot` in place, and no other slot. None when the ring
        is not one host array now (write through `write`); then no guard has run."""
        ...


class HostRing:
    """The ring in one host numpy array, zeros at first; the GEMV runs in the caller's
    thread. Bit-identical to any `TieredHistory` holding the same values.

    Args:
        slots: b - 1 ring slots.
        width: columns in all.
        dtype: float32 or float64.
    """

    plan: dict[str, Any] | None = None

    def __init__(self, slots: int, width: int, dtype: np.dtype[Any] | str) -> None:
        dt = np.dtype(dtype)
        if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise ValueError(f"HostRing dtype={dt} must be float32 or float64")
        if slots < 0 or width < 0:
            raise ValueError(f"HostRing shape ({slots}, {width}) must not be negative")
        self.slots, self.width, self.dtype = slots, width, dt
        self._ring: np.ndarray | None = np.zeros((slots, width), dtype=dt)

    @classmethod
    def holding(cls, ring: np.ndarray) -> HostRing:
        """A ring over `ring` itself, (slots, width), not a copy (a resume fills one
        array and hands it over).

        Raises:
            ValueError: `ring` is not 2-D float32 or float64.
        """
        if ring.ndim != 2:
            raise ValueError(f"HostRing.holding: ring is {ring.ndim}-D, expected (slots, width)")
        out = cls(0, 0, ring.dtype)
        out.slots, out.width, out._ring = ring.shape[0], ring.shape[1], ring
        return out

    def __repr__(self) -> str:
        return f"HostRing(slots={self.slots}, width={self.width}, dtype={self.dtype})"

    @property
    def nbytes(self) -> int:
        return self.slots * self.width * self.dtype.itemsize

    def placement(self) -> list[dict[str, Any]]:
        return [{"tier": "host", "start": 0, "stop": self.width}] if self.width else []

    def _array(self) -> np.ndarray:
        if self._ring is None:
            raise ValueError(f"{self!r} is closed: build a new ring to hold noise again")
        return self._ring

    def _slot(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise IndexError(f"ring slot {slot} is outside [0, {self.slots})")
        return slot

    def write(self, slot: int, w: np.ndarray) -> None:
        if w.shape != (self.width,):
            raise ValueError(f"ring slot values {w.shape}, the ring is ({self.width},) wide")
        self._array()[self._slot(slot)] = w

    def open_slot(self, slot: int) -> np.ndarray | None:
        self._slot(slot)
        return self._array()

    def read(self, slot: int, out: np.ndarray | None = None) -> np.ndarray:
        row = self._array()[self._slot(slot)]
        if out is None:
            copied: np.ndarray = row.copy()
            return copied
        out[...] = row
        return out

    def gather(self) -> np.ndarray:
        return self._array().copy()

    def scatter(self, ring: np.ndarray) -> None:
        if ring.shape != (self.slots, self.width):
            raise ValueError(f"ring {ring.shape}, history ({self.slots}, {self.width})")
        self._array()[...] = ring

    def gemv(self, mix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        # mix_history casts mix to the ring's dtype first, as every tier does.
        return mix_history(mix, self._array(), out)

    def close(self) -> None:
        self._ring = None


def shard_ring(
    given: RingHistory | None, slots: int, width: int, np_dtype: str, what: str
) -> RingHistory:
    """The ring a noise shard keeps: `given`, checked to be (slots, width) of `np_dtype`,
    or a `HostRing` of that shape (the BandMF ring and the BLT buffers alike).

    Raises:
        ValueError: `given` has another shape or dtype (`what` names it).
    """
    if given is None:
        return HostRing(slots, width, np_dtype)
    if (given.slots, given.width, given.dtype.name) != (slots, width, np_dtype):
        raise ValueError(
            f"{what} ({given.slots}, {given.width}) {given.dtype}, the shard needs "
            f"({slots}, {width}) {np_dtype}"
        )
    return given


def load_ring_into(into: RingHistory, ring: Any, what: str, fix: str = "") -> None:
    """Copy a stored or live `ring` into `into` (a no-op when they are one object).

    Raises:
        TypeError: `ring` is not a `RingHistory`.
        ValueError: its shape or dtype is not `into`'s (`what` names it; `fix` says what
            to do).
    """
    if not isinstance(ring, RingHistory):
        raise TypeError(f"{what} a {type(ring).__name__}; expected a RingHistory")
    want = (into.slots, into.width, into.dtype)
    if (ring.slots, ring.width, ring.dtype) != want:
        raise ValueError(
            f"{what} {ring.dtype}({ring.slots}, {ring.width}), expected "
            f"{want[2]}({want[0]}, {want[1]}){fix}"
        )
    if ring is not into:
        for slot in range(into.slots):  # one row at a time: a ring may exceed host memory
            into.write(slot, ring.read(slot))
