"""`RetentionTests`: what retention keeps and deletes, on every backend (a part of
`StoreTests`, which supplies the `location` and `writer` fixtures)."""

from __future__ import annotations

import numpy as np
import pytest

from .. import hooks
from ..errors import CorruptVersionError
from ..manifest import ArrayMeta
from ..paths import manifest_path, version_folder
from ..retention import KeepVersions
from ..store import Store
from .commits import InjectedCrash, commit, crash_after, same
from .locations import StoreLocation, flip_bit, open_store

__all__ = ["RetentionTests"]

_MODEL = {"model/w": np.arange(6.0), "optim/0/m": np.ones((2, 3), dtype=np.float32)}


def _ring_job(store: Store, versions: int) -> None:
    """`versions` versions that each write a model, an optimizer state and one ring
    slot, and reference the three slots before theirs (a ring of b - 1 = 4 slots): an
    older folder stays needed for its slot long after its model is not."""
    slots: dict[int, ArrayMeta] = {}
    for step in range(1, versions + 1):
        txn = store.begin(step)
        for name, arr in _MODEL.items():
            txn.put_array(name, arr + step)
        slots[step] = txn.put_array(f"ring/w-{step:04d}", np.full(3, float(step)))
        for old in range(max(1, step - 3), step):
            txn.reference(f"ring/w-{old:04d}", slots[old])
        txn.commit()


def _verify_all(store: Store) -> None:
    for v in store.versions():
        got = store.read(v)  # every array read back and checked
        assert same(got.array("model/w"), _MODEL["model/w"] + got.step)
        for name in got.array_names():
            if name.startswith("ring/w-"):
                assert same(got.array(name), np.full(3, float(int(name[-4:]))))


class RetentionTests:
    """Retention's conformance tests."""

    # by version ----------------------------------------------------------------------
    def test_retention_keeps_the_newest_and_what_they_reference(self, writer: Store) -> None:
        shared = writer.put_shared("csc/values", np.arange(4, dtype=np.int32))
        for step in range(1, 5):
            txn = writer.begin(step)
            txn.put_array("w", np.full(3, float(step)))
            txn.reference("csc", shared)
            if step > 1:
                txn.reference("first", writer.manifest(1).arrays["w"])
            txn.commit()
        deleted = writer.retain(keep_last=2)
        assert writer.versions() == [3, 4]
        assert manifest_path(2) in deleted and version_folder(2, 1) in deleted
        assert version_folder(1, 1) not in deleted  # version 4 still references it
        for v in (3, 4):
            got = writer.read(v)
            assert same(got.array("first"), np.full(3, 1.0))
            assert same(got.array("csc"), np.arange(4, dtype=np.int32))
            assert same(got.array("w"), np.full(3, float(v)))

    def test_retention_policies_add_to_what_is_kept(self, writer: Store) -> None:
        for step in range(1, 5):
            commit(writer, step, {"w": np.full(2, float(step))})
        writer.retain(keep_last=2, policies=[KeepVersions(frozenset({1}))])
        assert writer.versions() == [1, 3, 4]
        with pytest.raises(ValueError, match="keep_last=1 must be >= 2"):
            writer.retain(keep_last=1)
        assert writer.versions() == [1, 3, 4]

    def test_retention_stops_on_a_damaged_manifest(self, writer: Store) -> None:
        for step in range(1, 4):
            commit(writer, step, {"w": np.full(2, float(step))})
        flip_bit(writer, manifest_path(1), 8 * 40)
        before = writer.backend.find("")
        with pytest.raises(CorruptVersionError, match="retention stopped, nothing was deleted"):
            writer.retain(keep_last=2)
        assert writer.backend.find("") == before
        deleted = writer.retain(keep_last=2, discard_damaged=True)
        assert manifest_path(1) in deleted and writer.versions() == [2, 3]

    def test_retention_interrupted_anywhere_leaves_every_listed_version_whole(
        self, writer: Store
    ) -> None:
        for step in range(1, 7):
            txn = writer.begin(step)
            txn.put_array("w", np.full(2, float(step)))
            if step > 1:
                txn.reference("first", writer.manifest(1).arrays["w"])
            txn.commit()
        for hits in (0, 2, 4):
            hooks.arm("retention.before_delete", crash_after(hits))
            try:
                with pytest.raises(InjectedCrash):
                    writer.retain(keep_last=2)
            finally:
                hooks.disarm("retention.before_delete")
            listed = writer.versions()
            assert listed[-2:] == [5, 6]
            for v in listed:
                got = writer.read(v)
                assert same(got.array("w"), np.full(2, float(v)))
        writer.retain(keep_last=2)
        assert writer.versions() == [5, 6]

    # by array ------------------------------------------------------------------------
    def test_retention_deletes_arrays_no_kept_manifest_references(self, writer: Store) -> None:
        _ring_job(writer, 6)
        writer.retain(keep_last=2)
        assert writer.versions() == [5, 6]
        _verify_all(writer)
        backend = writer.backend
        # version 2's folder holds slot 2, still referenced by 5; its model went
        files = backend.find(version_folder(2, 1))
        assert any("/ring/w-0002/" in f for f in files)
        assert not any("/model/" in f or "/optim/" in f for f in files)
        assert not backend.exists(version_folder(1, 1))  # nothing referenced: gone whole
        space = writer.space()
        assert space.unreachable == 0 and space.in_flight == 0
        assert space.referenced > 0 and space.data == space.referenced + space.scaffolding

    def test_space_reports_what_retention_reclaims(self, writer: Store) -> None:
        _ring_job(writer, 6)
        hooks.arm("retention.before_delete", crash_after(0, what="folder"))
        try:
            with pytest.raises(InjectedCrash):  # manifests gone, no array deleted yet
                writer.retain(keep_last=2)
        finally:
            hooks.disarm("retention.before_delete")
        before = writer.space()
        assert before.unreachable > 0
        sizes = writer.backend.sizes("")
        deleted = writer.retain(keep_last=2)
        freed = sum(
            size
            for rel, size in sizes.items()
            if any(rel == d or rel.startswith(d + "/") for d in deleted)
        )
        assert freed == before.unreachable
        after = writer.space()
        assert after.unreachable == 0 and after.referenced == before.referenced

    def test_a_damaged_manifest_stops_array_deletion(self, writer: Store) -> None:
        _ring_job(writer, 4)
        flip_bit(writer, manifest_path(1), 8 * 40)
        before = writer.backend.find("")
        with pytest.raises(CorruptVersionError, match="retention stopped, nothing was deleted"):
            writer.retain(keep_last=2)
        assert writer.backend.find("") == before
        space = writer.space()
        assert space.unreadable == (1,)
        assert space.unreachable == 0  # what the damaged manifest names is not counted

    def test_retention_leaves_a_version_in_flight_alone(self, writer: Store) -> None:
        _ring_job(writer, 4)
        txn = writer.begin(5)
        txn.put_array("model/w", _MODEL["model/w"] + 5)
        txn.put_array("ring/w-0005", np.full(3, 5.0))
        writer.retain(keep_last=2)
        assert writer.space().in_flight > 0
        txn.commit()
        _verify_all(writer)

    def test_retention_interrupted_among_arrays_then_reopened(
        self, writer: Store, location: StoreLocation
    ) -> None:
        _ring_job(writer, 7)
        for hits in (0, 1, 3):
            hooks.arm("retention.before_delete", crash_after(hits, what="array"))
            try:
                with pytest.raises(InjectedCrash):
                    writer.retain(keep_last=2)
            finally:
                hooks.disarm("retention.before_delete")
            _verify_all(open_store(location, create=False))
        writer.retain(keep_last=2)
        _verify_all(writer)
        assert writer.space().unreachable == 0
