"""A conformance suite for `state` backends, shipped with the library (as zarr ships
`zarr.testing`): `StoreTests` holds the behaviour every backend must show, and
`StoreStateMachine` compares a store with a dict model under crashes, retention,
reopening and damage. Needs pytest and hypothesis (the `test` extra).

    from state.testing import StoreTests, memory_locations

    class TestMemory(StoreTests):
        @pytest.fixture
        def locations(self):
            return memory_locations()
"""

from .locations import (
    LocationFactory,
    StoreLocation,
    flip_bit,
    local_locations,
    memory_locations,
    open_store,
    restore,
    s3_locations,
)
from .stateful import COMMIT_POINTS, StoreStateMachine
from .store_tests import StoreTests

__all__ = [
    "COMMIT_POINTS",
    "LocationFactory",
    "StoreLocation",
    "StoreStateMachine",
    "StoreTests",
    "flip_bit",
    "local_locations",
    "memory_locations",
    "open_store",
    "restore",
    "s3_locations",
]
