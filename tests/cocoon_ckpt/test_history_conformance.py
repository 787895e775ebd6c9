"""The `RingHistory` conformance suite (`cocoon_ckpt.tiers.testing.history_tests`) on
the plain host ring and on the tiered history on every tier: device (torch on the CPU
here; CUDA where present), host, far (a real worker process over a memory-mapped file),
a split over all three, and the two pull-to baselines."""

from __future__ import annotations

from pathlib import Path

import pytest

from cocoon_ckpt.dp.noise import BLOCK
from cocoon_ckpt.dp.ring import HostRing
from cocoon_ckpt.tiers.base import GemvMode
from cocoon_ckpt.tiers.history import TieredHistory
from cocoon_ckpt.tiers.testing.history_tests import HistoryFactory, RingHistoryTests, tiered

MIB = 1 << 20


class TestHostRing(RingHistoryTests):
    @pytest.fixture
    def make(self) -> HistoryFactory:
        return HostRing


class TestSingleHost(RingHistoryTests):
    @pytest.fixture
    def make(self) -> HistoryFactory:
        return TieredHistory.single_host


class TestDeviceTier(RingHistoryTests):
    @pytest.fixture
    def make(self) -> HistoryFactory:
        return tiered(device_bytes=64 * MIB, host_bytes=0, far_bytes=0)


class TestHostTier(RingHistoryTests):
    @pytest.fixture
    def make(self) -> HistoryFactory:
        return tiered(device_bytes=0, host_bytes=64 * MIB, far_bytes=0)


class TestFarTier(RingHistoryTests):
    @pytest.fixture
    def make(self, tmp_path: Path) -> HistoryFactory:
        return tiered(device_bytes=0, host_bytes=0, far_bytes=64 * MIB, far_dir=str(tmp_path))


class TestSplitOverThreeTiers(RingHistoryTests):
    """One 65,536-column unit on each tier and a partial last one: the columns cross
    every tier boundary."""

    width = 3 * BLOCK + 123

    @pytest.fixture
    def make(self, tmp_path: Path) -> HistoryFactory:
        return tiered(
            device_bytes=64 * MIB,
            host_bytes=64 * MIB,
            far_bytes=64 * MIB,
            far_dir=str(tmp_path),
            counts={"device": 1, "host": 2, "far": 1},
        )


@pytest.mark.parametrize("mode", [GemvMode.PULL_TO_DEVICE, GemvMode.PULL_TO_HOST])
class TestPullBaselines(RingHistoryTests):
    width = 2 * BLOCK + 7

    @pytest.fixture
    def make(self, tmp_path: Path, mode: GemvMode) -> HistoryFactory:
        return tiered(
            device_bytes=64 * MIB,
            host_bytes=64 * MIB,
            far_bytes=64 * MIB,
            far_dir=str(tmp_path),
            counts={"device": 1, "host": 1, "far": 1},
            mode=mode,
        )
