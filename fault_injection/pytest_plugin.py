"""pytest plugin (entry point `cocoon_ckpt`): fixtures for a crash test of your own job.

    def test_my_job_survives_crashes(golden_run, crash_schedule, faulty_store, noise_key_file):
        ref = golden_run(config)
        url, fs = faulty_store(transient=0.1)
        options = JobOptions(fs=fs, key_file=noise_key_file)
        trace, divergence = verify(config, url, crash_schedule(config, n=3), ref, options=options)
        assert divergence is None

Each fixture is a factory, so one test can make several.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

# pytest loads this plugin (entry point pytest11) in every run of every project in the
# environment: torch and zarr load inside the fixtures, only in tests that use them
# (importing them here made an unrelated project's pytest start 1.0 s -> 3.7 s).
if TYPE_CHECKING:
    from cocoon_ckpt import JobConfig, JobOptions

    from .faulty_fs import FaultyFileSystem
    from .trace import Trace

__all__ = ["crash_schedule", "faulty_store", "golden_run", "noise_key_file"]


@pytest.fixture
def noise_key_file(tmp_path: Path) -> str:
    """One key file shared by a test's golden and faulted runs (same key, same noise)."""
    return str(tmp_path / "noise.key")


@pytest.fixture
def golden_run(tmp_path: Path, noise_key_file: str) -> Callable[..., Trace]:
    """`golden_run(config, parts=None, options=None) -> Trace` of an uninterrupted run
    (`run_job`'s `parts` and `options`), its key in `noise_key_file` unless `options`
    names another."""

    def make(config: JobConfig, parts: Any = None, options: JobOptions | None = None) -> Trace:
        import dataclasses

        from cocoon_ckpt import JobOptions

        from .trace import golden

        options = options or JobOptions()
        if options.key_file is None:
            options = dataclasses.replace(options, key_file=noise_key_file)
        url = str(tmp_path / f"golden-{uuid.uuid4().hex[:8]}.zarr")
        return golden(config, url, parts, options=options)

    return make


@pytest.fixture
def crash_schedule(request: pytest.FixtureRequest) -> Callable[..., list[tuple[str, int | None]]]:
    """`crash_schedule(config, n=3, points=None, seed=None)`: n (crash point, step) pairs
    at steps where each point fires (see `draw_schedule`), seeded by the test's id unless
    `seed` is given, so a failure replays."""

    def make(
        config: JobConfig, n: int = 3, points: list[str] | None = None, seed: int | None = None
    ) -> list[tuple[str, int | None]]:
        from .chaos import draw_schedule

        rng = random.Random(request.node.nodeid if seed is None else seed)
        return draw_schedule(config, n, rng, points)

    return make


@pytest.fixture
def faulty_store() -> Callable[..., tuple[str, FaultyFileSystem]]:
    """`faulty_store(target="memory://", **FaultPlan fields) -> (url, fs)`: a fresh store
    location on `faulty://` storage; pass `fs=fs` to run_job / verify."""

    def make(target: str = "memory://", **plan: Any) -> tuple[str, FaultyFileSystem]:
        from .faulty_fs import FaultPlan, faulty_filesystem

        fs = faulty_filesystem(target, FaultPlan(**plan))
        return f"/cocoon-{uuid.uuid4().hex}", fs

    return make
