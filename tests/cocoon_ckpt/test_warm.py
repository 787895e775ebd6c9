"""`train.warm`: the kernels' warm-up runs once per process and kind, in a daemon thread,
and the noise it runs beside is the noise without it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from cocoon_ckpt.dp.default_noise import BLOCK, keyed_gaussians
from cocoon_ckpt.train import warm


def test_the_warm_up_starts_once_and_changes_no_draw() -> None:
    key = bytes(range(32))
    before = keyed_gaussians(key, 3, 0, 3 * BLOCK, np.empty(3 * BLOCK, np.float64), 1.5, 2)
    first = warm.warm_kernels("float64", ziggurat=True, threads=2)
    again = warm.warm_kernels("float64", ziggurat=True, threads=2)
    during = keyed_gaussians(key, 3, 0, 3 * BLOCK, np.empty(3 * BLOCK, np.float64), 1.5, 2)
    assert first.daemon
    first.join()
    assert again is first  # the one thread of its kind, whoever started it
    after = keyed_gaussians(key, 3, 0, 3 * BLOCK, np.empty(3 * BLOCK, np.float64), 1.5, 2)
    assert np.array_equal(before, during) and np.array_equal(before, after)


def test_every_kernel_of_the_warm_up_loads_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the warm-up swallows its errors (a failed one leaves the first step the load): a
    # kernel it calls wrongly would go unwarmed and unseen
    for dtype in (np.float32, np.float64):
        with caplog.at_level(logging.DEBUG, logger=warm.__name__):
            warm._warm(np.dtype(dtype), True, 2)
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
