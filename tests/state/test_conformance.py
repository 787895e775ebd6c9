"""Every backend runs `state.testing.StoreTests`: local disk, memory://, S3 on a local
server, and the fault-injecting wrapper over memory:// (transient errors and lost
responses at low rates: the suite must pass through the retries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from state import FsspecBackend, LocalBackend, Store
from state.testing import (
    LocationFactory,
    StoreLocation,
    StoreTests,
    local_locations,
    memory_locations,
    s3_locations,
)


class TestLocal(StoreTests):
    # every commit fsyncs each file and folder: a shorter state machine than memory's
    state_machine_examples = 4
    state_machine_steps = 8

    @pytest.fixture
    def locations(self, tmp_path: Path) -> LocationFactory:
        return local_locations(tmp_path)

    def test_is_the_local_backend(self, writer: Store) -> None:
        assert isinstance(writer.backend, LocalBackend)
        assert writer.backend.capabilities.fsync and writer.backend.capabilities.permissions


class TestMemory(StoreTests):
    @pytest.fixture
    def locations(self) -> LocationFactory:
        return memory_locations()

    def test_is_an_fsspec_backend(self, writer: Store) -> None:
        assert isinstance(writer.backend, FsspecBackend)
        assert writer.backend.capabilities.exclusive_create
        assert not writer.backend.capabilities.fsync


class TestS3(StoreTests):
    # Every operation is a request to the local server: a short state machine.
    state_machine_examples = 2
    state_machine_steps = 4

    @pytest.fixture
    def locations(self, s3_endpoint: dict[str, Any]) -> LocationFactory:
        return s3_locations(s3_endpoint["bucket"], s3_endpoint["storage_options"])


class TestFaulty(StoreTests):
    state_machine_examples = 4

    @pytest.fixture
    def faulty(self) -> Any:
        from fault_injection.faulty_fs import FaultPlan, faulty_filesystem

        return faulty_filesystem(
            "memory://", FaultPlan(seed=11, transient=0.05, lost_response=0.02)
        )

    @pytest.fixture
    def locations(self, faulty: Any) -> LocationFactory:
        base = memory_locations()
        return lambda: StoreLocation(url=base().url.removeprefix("memory://"), fs=faulty)

    def test_faults_were_injected_and_absorbed(self, writer: Store, faulty: Any) -> None:
        for step in range(1, 4):
            txn = writer.begin(step)
            for k in range(8):
                txn.put_array(f"a{k}", np.full(3, float(step)))
            txn.commit()
        for v in writer.versions():
            writer.read(v)
        assert faulty.injected["transient"] > 0 and faulty.injected["lost_response"] > 0
