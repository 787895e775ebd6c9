"""Retention verifies each manifest once, and never trusts one altered after that."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest

from state import CorruptVersionError, Manifest, Store, restamp
from state.paths import manifest_path


def _open(loc: dict[str, Any], **kw: Any) -> Store:
    return Store.open(loc["url"], storage_options=loc["storage_options"], **kw)


def _commit(store: Store, step: int) -> int:
    txn = store.begin(step)
    txn.put_array("model/w", np.full(8, step, dtype=np.float32))
    txn.put_record("metrics", {"loss": [0.5] * step})
    return txn.commit().version


def _rewrite(store: Store, version: int, data: bytes) -> None:
    rel = manifest_path(version)
    store.backend.rm(rel)
    store.backend.fs.pipe_file(store.backend.path(rel), data)


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many times each version's manifest was parsed and verified."""
    counts: Counter[int] = Counter()
    parse = Manifest.from_bytes.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Manifest], data: bytes, *, version: int, where: str) -> Manifest:
        counts[version] += 1
        return parse(cls, data, version=version, where=where)  # type: ignore[no-any-return]

    monkeypatch.setattr(Manifest, "from_bytes", classmethod(counted))
    return counts


def test_retention_after_every_commit_verifies_each_manifest_once(
    store_location: dict[str, Any], verifications: Counter[int]
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    n = 12
    for step in range(1, n + 1):
        v = _commit(store, step)
        store.retain(keep_last=3, newest_valid=v)
    assert store.versions() == [n - 2, n - 1, n]
    # The committing store knows its own manifests' bytes: none is verified again,
    # though each is read at every retention.
    assert verifications == Counter()
    assert len(store.manifest_cache) == 3  # deleted versions are forgotten
    # Another process (a new Store object, an empty cache) verifies each once.
    other = _open(store_location)
    for _ in range(3):
        other.manifest_cache.keep_only(other.versions())
        for v in other.versions():
            other.manifest_cache.manifest(other, v)
    assert verifications == Counter(range(n - 2, n + 1))


def test_a_committed_manifest_is_cached_as_a_verified_read_would_give_it(
    store_location: dict[str, Any],
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    v = _commit(store, 4)
    cached = store.manifest_cache.manifest(store, v)
    read = Manifest.from_bytes(
        store.backend.read_bytes(manifest_path(v)), version=v, where=store.url
    )
    assert cached == read
    assert cached.records["metrics"] == {"loss": [0.5] * 4}


def test_a_manifest_altered_after_it_was_verified_is_verified_again(
    store_location: dict[str, Any], verifications: Counter[int]
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    for step in (1, 2, 3):
        _commit(store, step)
    store.retain(keep_last=3, newest_valid=3)
    raw = store.backend.read_bytes(manifest_path(1))
    # Same length, still valid JSON: only a checksum can tell.
    damaged = raw.replace(b'"step": 1', b'"step": 7', 1)
    assert len(damaged) == len(raw) and damaged != raw
    _rewrite(store, 1, damaged)
    before = set(store.backend.find(""))
    with pytest.raises(CorruptVersionError, match="retention stopped, nothing was deleted"):
        store.retain(keep_last=2, newest_valid=3)
    assert set(store.backend.find("")) == before
    assert verifications[1] == 1  # committed here, so first verified once damaged
    # A rewrite that recomputes every checksum (a writer who can) is a new manifest:
    # verified again and read as what it now says, not as the cached one.
    doc = json.loads(raw)
    doc["step"] = 9
    _rewrite(store, 1, restamp(doc))
    assert store.manifest_cache.manifest(store, 1).step == 9
    assert verifications[1] == 2
    # Put back, retention goes on and deletes it.
    _rewrite(store, 1, raw)
    store.retain(keep_last=2, newest_valid=3)
    assert store.versions() == [2, 3]


def test_a_damaged_manifest_is_not_cached_and_still_stops_retention(
    store_location: dict[str, Any], verifications: Counter[int]
) -> None:
    store = _open(store_location)
    store.acquire_lease()
    for step in (1, 2, 3):
        _commit(store, step)
    raw = store.backend.read_bytes(manifest_path(1))
    _rewrite(store, 1, raw[: len(raw) // 2])
    for _ in range(2):  # the second retention fails as the first: nothing was cached
        with pytest.raises(CorruptVersionError, match="version 1"):
            store.retain(keep_last=2, newest_valid=3)
    assert store.versions() == [1, 2, 3]
    assert verifications[1] == 2
