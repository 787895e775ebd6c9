"""`StoreTests`: the behaviour every backend must show, as pytest tests.

Subclass it once per backend and override the `locations` fixture::

    class TestMemory(StoreTests):
        @pytest.fixture
        def locations(self) -> LocationFactory:
            return memory_locations()
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from .. import hooks
from ..errors import (
    CorruptVersionError,
    FencedError,
    ForgedVersionError,
    LeaseHeldError,
    NotAStoreError,
    StoreError,
    StoreNotFoundError,
    UnauthenticatedVersionError,
)
from ..manifest import FORMAT_VERSION, MAC_KEY_BYTES, restamp
from ..paths import manifest_path, version_of_path
from ..store import Store
from .commits import InjectedCrash, commit, crash_after, same
from .locations import (
    LocationFactory,
    StoreLocation,
    backend_of,
    flip_bit,
    open_store,
    restore,
)
from .retention_tests import RetentionTests
from .stateful import StoreStateMachine

__all__ = ["StoreTests"]


class StoreTests(RetentionTests):
    """The conformance suite. A subclass supplies `locations`; it may lower
    `state_machine_examples` / `state_machine_steps` for a slow backend."""

    #: Hypothesis examples of the state machine, and steps per example.
    state_machine_examples = 8
    state_machine_steps = 10

    @pytest.fixture
    def locations(self) -> LocationFactory:
        """Override: a factory of fresh, empty store locations for this backend."""
        raise NotImplementedError("a StoreTests subclass must override the locations fixture")

    @pytest.fixture
    def location(self, locations: LocationFactory) -> StoreLocation:
        return locations()

    @pytest.fixture
    def writer(self, location: StoreLocation) -> Store:
        """A new store holding the writer lease."""
        store = open_store(location)
        store.acquire_lease()
        return store

    # create / open -----------------------------------------------------------------
    def test_create_then_open(self, location: StoreLocation) -> None:
        with pytest.raises(StoreNotFoundError):
            open_store(location, create=False)
        created = open_store(location)
        assert created.attributes["format_version"] == FORMAT_VERSION
        again = open_store(location, create=False)
        assert again.versions() == [] and again.latest() is None
        assert again.attributes == created.attributes

    def test_refuses_a_foreign_location_writing_nothing(self, location: StoreLocation) -> None:
        backend = backend_of(location)
        backend.makedirs("")
        backend.write_once("notes.txt", b"not a store")
        before = backend.find("")
        with pytest.raises(NotAStoreError, match="notes.txt"):
            open_store(location)
        assert backend.find("") == before

    def test_a_lost_create_race_is_a_conflict(self, location: StoreLocation) -> None:
        """Another process creates first while this one holds a cached listing (s3fs
        caches them): the exclusive create must end in FileExistsError, not in a
        FileNotFoundError read from the stale listing."""
        ours = backend_of(location)
        ours.makedirs("")
        ours.write_once("first.json", b"{}")
        assert ours.listdir("") == ["first.json"]  # a listing the filesystem may cache
        theirs = backend_of(location, fresh=True)
        theirs.create_once("race.json", b"theirs")
        with pytest.raises(FileExistsError):
            ours.create_once("race.json", b"ours")
        ours.create_once("race.json", b"theirs")  # the same bytes: a lost response's retry

    # commit and read back ------------------------------------------------------------
    def test_commit_then_read_back_verified(self, writer: Store, location: StoreLocation) -> None:
        arrays = {
            "model/w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "ring/slot-0": np.array([1.5, -0.0, np.inf]),
            "step": np.array(7, dtype=np.int64),
            "empty": np.zeros((0, 3), dtype=np.uint8),
            "mask": np.array([True, False]),
        }
        v = commit(writer, 7, arrays, sampler={"seed": 3, "q": 0.25}, note="x")
        got = open_store(location, create=False).latest()
        assert got is not None and (got.version, got.step) == (v, 7)
        assert got.records == {"sampler": {"seed": 3, "q": 0.25}, "note": "x"}
        assert got.array_names() == sorted(arrays)
        for name, want in arrays.items():
            assert same(got.array(name), want), name

    def test_nothing_is_visible_beforecommit(self, writer: Store) -> None:
        commit(writer, 1, {"a": np.zeros(3)})
        txn = writer.begin(2)
        txn.put_array("a", np.ones(3))
        txn.put_record("r", 1)
        assert writer.versions() == [1]
        latest = writer.latest()
        assert latest is not None and latest.step == 1

    def test_a_commit_interrupted_at_each_point_is_invisible(self, writer: Store) -> None:
        commit(writer, 1, {"a": np.zeros(4)})
        points = [
            "checkpoint.before_array",
            "checkpoint.after_array",
            "checkpoint.after_arrays",
            "checkpoint.before_manifest",
        ]
        if writer.backend.local:  # only local disk writes the manifest through a temp
            points.append("checkpoint.after_manifest_temp")
        for point in points:
            hooks.arm(point, crash_after(0))
            try:
                with pytest.raises(InjectedCrash):
                    commit(writer, 2, {"a": np.ones(4)})
            finally:
                hooks.disarm(point)
            assert writer.versions() == [1], point
        # the next try at the same number clears what the crashed ones left
        assert commit(writer, 2, {"a": np.ones(4)}) == 2
        got = writer.read(2)
        assert same(got.array("a"), np.ones(4))

    def test_references_read_the_older_array(self, writer: Store) -> None:
        commit(writer, 1, {"ring/w-0": np.full(5, 1.0), "model": np.zeros(2)})
        old = writer.manifest(1).arrays["ring/w-0"]
        txn = writer.begin(2, parent=1)
        txn.reference("ring/w-0", old)
        txn.put_array("ring/w-1", np.full(5, 2.0))
        manifest = txn.commit()
        assert txn.bytes_written == 40
        assert manifest.arrays["ring/w-0"].path == old.path
        assert version_of_path(old.path) == 1
        assert same(writer.read(2).array("ring/w-0"), np.full(5, 1.0))

    # damage -------------------------------------------------------------------------
    def test_damage_is_refused_by_name_and_fallback_is_explicit(self, writer: Store) -> None:
        commit(writer, 1, {"a": np.arange(6.0)})
        commit(writer, 2, {"a": np.arange(6.0) + 1})
        path = writer.manifest(2).arrays["a"].path
        chunk = next(p for p in writer.backend.find(path) if "/c." in p)
        flip_bit(writer, chunk, 3)
        with pytest.raises(CorruptVersionError, match="allow_fallback=True to use version 1") as e:
            writer.latest()
        assert (e.value.version, e.value.path) == (2, path)
        fallback = writer.latest(allow_fallback=True)
        assert fallback is not None and fallback.version == 1

    def test_a_damaged_manifest_names_itself(self, writer: Store) -> None:
        commit(writer, 1, {"a": np.zeros(2)}, sampler={"seed": 1})
        data = writer.backend.read_bytes(manifest_path(1))
        at = data.index(b'"seed": 1') + len(b'"seed": ')
        flip_bit(writer, manifest_path(1), at * 8)  # '1' -> '0'
        with pytest.raises(CorruptVersionError) as e:
            writer.read(1)
        assert (e.value.version, e.value.path, e.value.record) == (1, manifest_path(1), "sampler")

    # authentication ---------------------------------------------------------------
    def test_sealed_versions_authenticate_and_forgeries_are_named(
        self, writer: Store, location: StoreLocation
    ) -> None:
        key, other = b"k" * MAC_KEY_BYTES, b"o" * MAC_KEY_BYTES
        writer.authenticate_with(key)
        commit(writer, 1, {"a": np.zeros(2)}, sampler={"seed": 1}, accountant={"steps": 1})
        commit(writer, 2, {"a": np.ones(2)}, sampler={"seed": 1}, accountant={"steps": 2})
        reader = open_store(location, create=False)
        assert reader.latest() is not None  # no key: the unkeyed checksums, as before
        reader.authenticate_with(key)
        newest = reader.latest()
        assert newest is not None and newest.manifest.sealed and newest.version == 2
        reader.authenticate_with(other)
        with pytest.raises(ForgedVersionError):
            reader.latest()
        reader.authenticate_with(key)
        # a writer without the key edits a record and re-stamps the checksums
        doc = json.loads(writer.backend.read_bytes(manifest_path(2)))
        doc["records"]["accountant"]["steps"] = 1
        restore(writer, manifest_path(2), restamp(doc, keep_macs=True))
        open_store(location, create=False).latest()  # the checksums alone see nothing
        with pytest.raises(ForgedVersionError, match="record 'accountant'") as e:
            reader.latest()
        assert (e.value.version, e.value.record) == (2, "accountant")
        fallback = reader.latest(allow_fallback=True)
        assert fallback is not None and fallback.version == 1
        # the header (the step), MACs kept; then the MACs stripped
        doc["records"]["accountant"]["steps"] = 2
        doc["step"] = 5
        restore(writer, manifest_path(2), restamp(doc, keep_macs=True))
        with pytest.raises(ForgedVersionError, match="the header") as e:
            reader.read(2)
        assert e.value.record == "header"
        restore(writer, manifest_path(2), restamp(doc))
        with pytest.raises(UnauthenticatedVersionError, match="carries no MAC"):
            reader.read(2)
        reader.authenticate_with(key, require=False)  # an old store's versions, allowed
        assert reader.read(2).step == 5 and not reader.read(2).manifest.sealed

    def test_an_unsealed_version_is_sealed_from_the_next_commit_on(self, writer: Store) -> None:
        commit(writer, 1, {"a": np.zeros(2)})  # as a store written before format 4
        writer.authenticate_with(b"k" * MAC_KEY_BYTES, require=False)
        commit(writer, 2, {"a": np.ones(2)})
        assert not writer.read(1).manifest.sealed
        assert writer.read(2).manifest.sealed
        writer.authenticate_with(b"k" * MAC_KEY_BYTES)
        with pytest.raises(UnauthenticatedVersionError):
            writer.read(1)
        assert writer.read(2).step == 2

    # leases -------------------------------------------------------------------------
    def test_lease_refuse_takeover_and_fence(self, writer: Store, location: StoreLocation) -> None:
        commit(writer, 1, {"a": np.zeros(2)})
        stale = writer.begin(2)
        stale.put_array("a", np.ones(2))
        other = open_store(location, create=False)
        with pytest.raises(LeaseHeldError, match="takeover=True"):
            other.acquire_lease()
        other.acquire_lease(takeover=True)
        with pytest.raises(FencedError):
            stale.commit()
        with pytest.raises(FencedError):
            writer.begin(2)
        assert other.versions() == [1]
        assert commit(other, 2, {"a": np.full(2, 2.0)}) == 2
        holder = other.lease_holder()
        assert holder is not None and holder["generation"] == 2

    def test_a_released_lease_is_taken_without_takeover(
        self, writer: Store, location: StoreLocation
    ) -> None:
        writer.release_lease()
        other = open_store(location, create=False)
        assert other.acquire_lease().generation == 2
        with pytest.raises(StoreError, match="needs the writer lease"):
            writer.begin(1)

    # shared arrays and secrets -------------------------------------------------------
    def test_shared_arrays_are_referenced_by_versions(self, writer: Store) -> None:
        meta = writer.put_shared("emb/csc", np.arange(10, dtype=np.int64))
        assert meta.path == "shared/emb/csc"
        for step in (1, 2):
            txn = writer.begin(step)
            txn.reference("csc", meta)
            txn.commit()
        for v in (1, 2):
            assert same(writer.read(v).array("csc"), np.arange(10, dtype=np.int64))

    def test_secrets_are_written_once(self, writer: Store) -> None:
        assert writer.get_secret("noise.key") is None
        writer.put_secret("noise.key", b"k" * 32)
        writer.put_secret("noise.key", b"k" * 32)  # the same bytes again: fine
        with pytest.raises(StoreError, match="never overwritten"):
            writer.put_secret("noise.key", b"x" * 32)
        assert writer.get_secret("noise.key") == b"k" * 32

    # the state machine ---------------------------------------------------------------
    def test_state_machine(self, locations: LocationFactory) -> None:
        class Bound(StoreStateMachine):
            """The machine over `locations`: hypothesis takes a class, not a closure."""

            def __init__(self) -> None:
                super().__init__(locations)

        # hypothesis before 6.16x leaves run_state_machine_as_test untyped; later ones type
        # it. The code list keeps mypy quiet on both (CI's lock and the newest release).
        run_state_machine_as_test(  # type: ignore[no-untyped-call,unused-ignore]
            Bound,
            settings=settings(
                max_examples=self.state_machine_examples,
                stateful_step_count=self.state_machine_steps,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
