"""`StoreStateMachine`: a store against a dict model, with crashes, retention and damage.

The model maps each committed version to its step, arrays and records. Rules commit
(some arrays referenced from the version before), commit interrupted at a crash point,
run retention (sometimes interrupted, among the manifests or among the arrays), reopen
the store as a new process would, and flip a bit at rest and check the damage is
refused. A retention that ran to its end leaves no unreachable byte. The invariant: the store lists
exactly the model's versions, and each reads back exactly as the model says.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from .. import hooks
from ..errors import CorruptVersionError, FencedError, FormatVersionError
from ..paths import manifest_path
from ..store import Store
from .locations import LocationFactory, flip_bit, open_store, restore

__all__ = ["COMMIT_POINTS", "StoreStateMachine"]

#: The crash points a single writer's commit passes, in order.
COMMIT_POINTS = (
    "checkpoint.before_array",
    "checkpoint.after_array",
    "checkpoint.after_arrays",
    "checkpoint.before_manifest",
    "checkpoint.after_manifest_temp",
    "checkpoint.after_manifest",
)
#: Points at or after which the manifest exists: the version is committed.
_VISIBLE_AFTER = {"checkpoint.after_manifest"}

_NAMES = ("w", "ring/slot-0", "ring/slot-1", "model/layer.0/bias")
_DTYPES = st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_])
_ARRAYS = hnp.arrays(
    dtype=_DTYPES, shape=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=4)
)
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)
_RECORDS = st.dictionaries(st.sampled_from(["sampler", "noise", "config"]), _JSON, max_size=2)


class _Crash(Exception):
    """Raised at an armed crash point by the machine."""


@dataclass(frozen=True, slots=True)
class _Model:
    step: int
    arrays: Mapping[str, np.ndarray]
    records: Mapping[str, Any]


def _crash_at(point: str, fired: list[str], after_hits: int = 0, **match: Any) -> None:
    """Arm `point` to raise _Crash on its hit number `after_hits` (from 0) among those
    whose context holds every `match` item, recording the point in `fired`."""
    remaining = [after_hits]

    def handler(name: str, ctx: Mapping[str, Any]) -> None:
        if any(ctx.get(k) != v for k, v in match.items()):
            return
        if remaining[0] > 0:
            remaining[0] -= 1
            return
        fired.append(name)
        raise _Crash(name)

    hooks.arm(point, handler)


class StoreStateMachine(RuleBasedStateMachine):
    """Compares a store at a fresh location of `locations` with a dict model."""

    def __init__(self, locations: LocationFactory) -> None:
        super().__init__()
        self.location = locations()
        self.store: Store = open_store(self.location)
        self.store.acquire_lease()
        self.model: dict[int, _Model] = {}
        self.step = 0

    def teardown(self) -> None:
        hooks.disarm_all()
        self.store.release_lease()

    # helpers -----------------------------------------------------------------------
    def _write(
        self,
        arrays: dict[str, np.ndarray],
        records: dict[str, Any],
        refs: set[str],
        holds: dict[str, np.ndarray],
    ) -> None:
        """Begin and commit one version; `holds` is filled, before the commit, with
        every array the version holds (the crash rules need it when commit raises)."""
        self.step += 1
        newest = max(self.model, default=None)
        txn = self.store.begin(self.step, parent=newest)
        holds.update(arrays)
        if newest is not None:
            manifest = self.store.manifest(newest)
            for name in sorted(refs - set(arrays)):
                if name in manifest.arrays:
                    txn.reference(name, manifest.arrays[name])
                    holds[name] = self.model[newest].arrays[name]
        for name, arr in arrays.items():
            txn.put_array(name, arr)
        for name, rec in records.items():
            txn.put_record(name, rec)
        txn.commit()

    def _expect(self, v: int, holds: dict[str, np.ndarray], records: dict[str, Any]) -> None:
        self.model[v] = _Model(
            step=self.step,
            arrays={k: a.copy() for k, a in holds.items()},
            records=dict(records),
        )

    # rules -------------------------------------------------------------------------
    @initialize(
        first=st.dictionaries(st.sampled_from(_NAMES), _ARRAYS, max_size=3),
        second=st.dictionaries(st.sampled_from(_NAMES), _ARRAYS, max_size=3),
        records=_RECORDS,
    )
    def two_versions(
        self,
        first: dict[str, np.ndarray],
        second: dict[str, np.ndarray],
        records: dict[str, Any],
    ) -> None:
        """Start with two versions, the second referencing all it can of the first, so
        that retention and references have something to work on from the start."""
        self.commit(first, records, set())
        self.commit(second, {}, set(_NAMES))

    @rule(
        arrays=st.dictionaries(st.sampled_from(_NAMES), _ARRAYS, max_size=3),
        records=_RECORDS,
        refs=st.sets(st.sampled_from(_NAMES)),
    )
    def commit(
        self, arrays: dict[str, np.ndarray], records: dict[str, Any], refs: set[str]
    ) -> None:
        version = max(self.store.versions(), default=0) + 1
        holds: dict[str, np.ndarray] = {}
        self._write(arrays, records, refs, holds)
        self._expect(version, holds, records)

    @rule(
        point=st.sampled_from(COMMIT_POINTS),
        arrays=st.dictionaries(st.sampled_from(_NAMES), _ARRAYS, min_size=1, max_size=2),
        refs=st.sets(st.sampled_from(_NAMES)),
    )
    def interrupted_commit(self, point: str, arrays: dict[str, np.ndarray], refs: set[str]) -> None:
        version = max(self.store.versions(), default=0) + 1
        fired: list[str] = []
        holds: dict[str, np.ndarray] = {}
        _crash_at(point, fired)
        try:
            self._write(arrays, {}, refs, holds)
        except _Crash:
            pass
        finally:
            hooks.disarm(point)
        # Committed: the commit returned (the point is not on this backend's path, as
        # a local temp manifest elsewhere), or it crashed once the manifest existed.
        if not fired or point in _VISIBLE_AFTER:
            self._expect(version, holds, {})

    def _retain_crashing(self, keep_last: int, crash_after: int | None, **match: Any) -> list[str]:
        """Run retention with `retention.before_delete` armed to crash on its hit
        `crash_after` among those matching `match` (None: no crash); the points that
        fired."""
        fired: list[str] = []
        if crash_after is not None:
            _crash_at("retention.before_delete", fired, after_hits=crash_after, **match)
        try:
            self.store.retain(keep_last=keep_last)
        except _Crash:
            pass
        finally:
            hooks.disarm("retention.before_delete")
        return fired

    @rule(keep_last=st.integers(2, 4), crash_after=st.none() | st.integers(0, 2))
    def retain(self, keep_last: int, crash_after: int | None) -> None:
        fired = self._retain_crashing(keep_last, crash_after)
        kept = sorted(self.model)[-keep_last:]
        listed = self.store.versions()
        assert set(kept) <= set(listed), (kept, listed)
        if not fired:
            assert listed == kept, (kept, listed)
            assert self.store.space().unreachable == 0
        self.model = {v: m for v, m in self.model.items() if v in listed}

    @rule(
        keep_last=st.integers(2, 3),
        what=st.sampled_from(["array", "folder"]),
        crash_after=st.integers(0, 2),
    )
    def retain_interrupted_among_arrays(self, keep_last: int, what: str, crash_after: int) -> None:
        """Retention crashes before deleting an unreferenced array (or a version folder
        holding none), once every manifest not kept is gone: the kept versions must
        read back whole, and a new process must see exactly them."""
        self._retain_crashing(keep_last, crash_after, what=what)
        kept = sorted(self.model)[-keep_last:]
        assert self.store.versions() == kept
        self.model = {v: self.model[v] for v in kept}
        self.reopen(takeover=True)

    @rule(takeover=st.booleans())
    def reopen(self, takeover: bool) -> None:
        """A new process opens the store: after a clean exit (released lease) or after
        a crash (takeover); the old writer is fenced either way."""
        old = self.store
        if not takeover:
            old.release_lease()
        self.store = open_store(self.location, create=False)
        self.store.acquire_lease(takeover=takeover)
        if takeover:
            try:
                old.begin(self.step + 1)
            except FencedError:
                pass
            else:
                raise AssertionError("a taken-over writer could begin a version")

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), bit=st.integers(0, 2**16))
    def damage_then_open(self, data: st.DataObject, bit: int) -> None:
        v = data.draw(st.sampled_from(sorted(self.model)))
        manifest = self.store.manifest(v)
        chunks = [
            p
            for meta in manifest.arrays.values()
            for p in self.store.backend.find(meta.path)
            if "/c" in p[len(meta.path) :]
        ]
        target = data.draw(st.sampled_from(chunks)) if chunks else manifest_path(v)
        original = flip_bit(self.store, target, bit)
        try:
            reopened = open_store(self.location, create=False)
            refused: type[Exception] | tuple[type[Exception], ...] = (
                CorruptVersionError
                if chunks
                else (CorruptVersionError, FormatVersionError)  # a flip in format_version
            )
            try:
                reopened.read(v)
            except refused:
                pass
            else:
                raise AssertionError(f"a flipped bit in {target} of version {v} was not found")
        finally:
            restore(self.store, target, original)

    # invariants --------------------------------------------------------------------
    @invariant()
    def every_version_reads_back_as_the_model_says(self) -> None:
        assert self.store.versions() == sorted(self.model)
        for v, want in self.model.items():
            got = self.store.read(v)
            assert got.step == want.step
            assert got.records == want.records
            assert got.array_names() == sorted(want.arrays)
            for name, arr in want.arrays.items():
                have = got.array(name)
                assert have.dtype == arr.dtype and have.shape == arr.shape, name
                assert have.tobytes() == arr.tobytes(), name
