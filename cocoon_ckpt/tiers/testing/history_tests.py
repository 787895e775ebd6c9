"""`RingHistoryTests`: the behaviour every `cocoon_ckpt.dp.ring.RingHistory` must show,
as pytest tests. The noise is bit-identical whatever holds its rows only if every
history keeps these promises.

Subclass it once per implementation (or tier split) and override the `make` fixture::

    class TestHost(RingHistoryTests):
        @pytest.fixture
        def make(self) -> HistoryFactory:
            return HostRing
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from cocoon_ckpt.dp.gemv import mix_history_reference
from cocoon_ckpt.dp.ring import RingHistory
from cocoon_ckpt.tiers.build import build_history
from cocoon_ckpt.tiers.config import TierConfig

__all__ = ["HistoryFactory", "RingHistoryTests", "tiered"]

#: (slots, width, dtype) -> a fresh history of that shape, zeros at first.
HistoryFactory = Callable[[int, int, str], RingHistory]


class RingHistoryTests:
    """The conformance suite. A subclass supplies `make`; it may set `width` (columns,
    enough to reach every tier of its split) and `slots`."""

    width = 1000
    slots = 5

    @pytest.fixture
    def make(self) -> HistoryFactory:
        """Override: a factory of fresh histories of this implementation."""
        raise NotImplementedError("a RingHistoryTests subclass must override the make fixture")

    @pytest.fixture
    def histories(self, make: HistoryFactory) -> Iterator[HistoryFactory]:
        """`make`, closing whatever it made after the test."""
        made: list[RingHistory] = []

        def build(slots: int, width: int, dtype: str) -> RingHistory:
            h = make(slots, width, dtype)
            made.append(h)
            return h

        yield build
        for h in made:
            h.close()

    @staticmethod
    def _rows(slots: int, width: int, dtype: str, seed: int = 0) -> np.ndarray:
        rows: np.ndarray = np.random.default_rng(seed).standard_normal((slots, width))
        return rows.astype(dtype)

    # shape ----------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_shape_and_zeros(self, histories: HistoryFactory, dtype: str) -> None:
        h = histories(self.slots, self.width, dtype)
        assert isinstance(h, RingHistory)
        assert (h.slots, h.width, h.dtype) == (self.slots, self.width, np.dtype(dtype))
        assert h.nbytes >= self.slots * self.width * np.dtype(dtype).itemsize
        assert np.array_equal(h.gather(), np.zeros((self.slots, self.width), dtype))

    def test_placement_covers_every_column_once(self, histories: HistoryFactory) -> None:
        h = histories(self.slots, self.width, "float32")
        parts = sorted(h.placement(), key=lambda p: int(p["start"]))
        assert all({"tier", "start", "stop"} <= set(p) for p in parts)
        edges = [0] + [int(p["stop"]) for p in parts]
        assert [int(p["start"]) for p in parts] == edges[:-1]
        assert edges[-1] == self.width and all(p["stop"] > p["start"] for p in parts)

    # data -----------------------------------------------------------------------------
    def test_write_then_read_every_slot(self, histories: HistoryFactory) -> None:
        h = histories(self.slots, self.width, "float32")
        rows = self._rows(self.slots, self.width, "float64")
        for s in reversed(range(self.slots)):
            h.write(s, rows[s].astype(np.float32))
        for s in range(self.slots):
            got = h.read(s)
            assert got.dtype == np.float32 and np.array_equal(got, rows[s].astype(np.float32))
        assert np.array_equal(h.gather(), rows.astype(np.float32))

    def test_reads_are_copies(self, histories: HistoryFactory) -> None:
        h = histories(self.slots, self.width, "float64")
        rows = self._rows(self.slots, self.width, "float64")
        h.scatter(rows)
        got, whole = h.read(1), h.gather()
        got[:] = 7.0
        whole[:] = 7.0
        assert np.array_equal(h.gather(), rows)

    def test_scatter_then_gather(self, histories: HistoryFactory) -> None:
        h = histories(self.slots, self.width, "float64")
        rows = self._rows(self.slots, self.width, "float64", seed=3)
        h.scatter(rows)
        assert np.array_equal(h.gather(), rows)
        with pytest.raises(ValueError):
            h.scatter(rows[:, :-1])

    # the GEMV -------------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_gemv_is_the_fixed_order_sum(self, histories: HistoryFactory, dtype: str) -> None:
        """Bit for bit `dp.gemv`'s definition, a float64 mix cast to the rows' dtype
        first: the promise that makes the noise independent of the tiers."""
        h = histories(self.slots, self.width, dtype)
        rows = self._rows(self.slots, self.width, dtype, seed=5)
        h.scatter(rows)
        for seed in range(3):
            mix = np.random.default_rng(100 + seed).standard_normal(self.slots)
            got = h.gemv(mix)
            want = mix_history_reference(mix, rows)
            assert got.shape == (self.width,) and got.dtype == np.dtype(dtype)
            assert np.array_equal(got, want)

    def test_gemv_of_no_slots_is_zero(self, histories: HistoryFactory) -> None:
        """b = 1 (DP-SGD) keeps no rows."""
        h = histories(0, self.width, "float32")
        assert h.gather().shape == (0, self.width)
        assert np.array_equal(h.gemv(np.zeros(0)), np.zeros(self.width, np.float32))

    def test_close_is_idempotent(self, make: HistoryFactory) -> None:
        h = make(self.slots, self.width, "float32")
        h.close()
        h.close()


def tiered(**config: Any) -> HistoryFactory:
    """A factory of `TieredHistory`s built by `build_history` under `TierConfig(**config)`."""
    cfg = TierConfig(**config)
    return lambda slots, width, dtype: build_history(slots, width, dtype, cfg)
