"""Records written by someone hostile to the store: nested past any sane depth, numbers of
thousands of digits, NaN, FIFOs and links in place of files, lease records that would
block every writer. Each is refused by name, before it is parsed or opened in a way that
could block, and the fallback and retention paths pass over it as over any damaged
version."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import numpy as np
import pytest

from state import (
    CommitConflictError,
    CorruptVersionError,
    Manifest,
    NotAStoreError,
    Store,
    StoreError,
    restamp,
)
from state.arrays import read_array
from state.canonical_json import (
    MAX_DEPTH,
    MAX_NUMBER_CHARS,
    JSONBoundsError,
    NonFiniteError,
    canonical_text,
    load_bounded,
)
from state.errors import UnsafeFileError
from state.lease import DamagedLeaseError, acquire_lease, current_holder
from state.paths import array_group, lease_heartbeat_path, lease_path, manifest_path
from state.process import this_host

# FIFO tests: the code must never block; this only turns a regression into a failure.
_NO_HANG = pytest.mark.timeout(60)


# -- the bounded loader --------------------------------------------------------------


def test_bounded_loader_takes_what_json_takes_within_the_bounds() -> None:
    doc = {"a": [1, 2.5, -3e-07, 1e300, None, True], "s": "NaN [[[ {{ 1e999 " + "9" * 500}
    text = json.dumps(doc)
    assert load_bounded(text) == json.loads(text)
    assert load_bounded(text.encode("utf-16")) == json.loads(text)
    nested: object = 1
    for _ in range(MAX_DEPTH - 1):
        nested = [nested]
    assert load_bounded(json.dumps({"x": nested})) == {"x": nested}
    assert load_bounded(str(10 ** (MAX_NUMBER_CHARS - 1))) == 10 ** (MAX_NUMBER_CHARS - 1)


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", f"nested deeper than {MAX_DEPTH} levels"),
        ('{"a": ' + "[" * (MAX_DEPTH) + "]" * MAX_DEPTH + "}", "nested deeper"),
        ('{"a": 1' + "0" * 5000 + "}", "a number of 5001 characters"),
        ('{"a": 0.' + "1" * 5000 + "}", "a number of 5002 characters"),
        ('{"a": [1, NaN]}', "holds NaN"),
        ('{"a": -Infinity}', "holds Infinity"),
        ('{"a": 2e400}', "beyond a float's range"),
    ],
)
def test_bounded_loader_refuses_before_parsing_and_says_where(text: str, said: str) -> None:
    with pytest.raises(JSONBoundsError, match=said) as e:
        load_bounded(text)
    assert isinstance(e.value, json.JSONDecodeError) and 5 <= e.value.pos < len(text)


def test_canonical_text_refuses_non_finite_numbers_naming_the_place() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(NonFiniteError, match=r"records/stateful/ema/state/1 is"):
            canonical_text({"records": {"stateful": {"ema": {"state": [1.0, bad]}}}})
        with pytest.raises(NonFiniteError, match=r"records/x/b/0 is"):
            canonical_text({"records": {"x": {"b": [{"c": 1, "d": "e"}, bad][::-1]}}})
    deep: object = 0
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(NonFiniteError, match=f"nests deeper than {MAX_DEPTH} levels"):
        canonical_text({"deep": deep})


def test_a_nan_in_a_record_never_reaches_a_manifest(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("w", np.zeros(3))
    with pytest.raises(NonFiniteError, match="records/stateful/ema/state/decay is nan"):
        txn.put_record("stateful", {"ema": {"kind": "EMA", "state": {"decay": math.nan}}})
    txn.commit()
    assert store.versions() == [1] and "stateful" not in store.manifest(1).records


# -- hostile manifests ----------------------------------------------------------------


def _three_versions(root: Path) -> Store:
    store = Store.open(str(root))
    store.acquire_lease()
    for step in (1, 2, 3):
        txn = store.begin(step)
        txn.put_array("w", np.full(4, step, dtype=np.float32))
        txn.put_record("sampler", {"seed": 3, "cursor": step})
        txn.commit()
    store.release_lease()
    return Store.open(str(root), create=False)


def _forge(store: Store, version: int, placeholder: object, text: str) -> None:
    """Rewrite version `version`'s manifest with record `extra` standing for `text`, its
    checksums re-stamped as a writer who recomputes them would (the bounds refuse the
    bytes before any checksum is looked at, so the text is put in after re-stamping)."""
    path = Path(store.backend.path(manifest_path(version)))
    doc = json.loads(path.read_bytes())
    doc["records"]["extra"] = placeholder
    data = restamp(doc)
    marker = json.dumps(placeholder).encode()
    assert data.count(marker) == 1
    path.write_bytes(data.replace(marker, text.encode()))


_HOSTILE = {
    "nested": ("[" * 5000 + "]" * 5000, "nested deeper than"),
    "digits": ("1" + "0" * 5000, "a number of 5001 characters"),
    "nan": ("NaN", "holds NaN"),
}


@pytest.mark.parametrize("kind", sorted(_HOSTILE))
def test_a_hostile_newest_manifest_is_damage_named_and_passed_over(
    tmp_path: Path, kind: str
) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    text, said = _HOSTILE[kind]
    _forge(store, 3, "@@hostile@@", text)
    with pytest.raises(CorruptVersionError, match=said) as e:
        store.latest()
    assert (e.value.version, e.value.path, e.value.record) == (3, manifest_path(3), "extra")
    assert "version 3" in str(e.value) and "allow_fallback=True to use version 2" in str(e.value)
    fallback = store.latest(allow_fallback=True)
    assert fallback is not None and fallback.version == 2
    assert store.space().unreadable == (3,)
    with pytest.raises(CorruptVersionError, match="version 3"):
        store.retain(keep_last=2)
    store.acquire_lease()
    store.retain(keep_last=2, discard_damaged=True)
    assert store.versions() == [1, 2]


def test_a_restamped_record_number_past_a_float_is_refused_by_name(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    _forge(store, 3, 0.5, "1e999")
    with pytest.raises(CorruptVersionError, match="beyond a float's range") as e:
        store.latest()
    assert e.value.record == "extra"


# -- FIFOs and links in place of a store's files -----------------------------------


def _fifo_at(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@_NO_HANG
def test_a_fifo_in_place_of_a_manifest_is_damage_not_a_hang(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    _fifo_at(Path(store.backend.path(manifest_path(3))))
    with pytest.raises(CorruptVersionError, match="manifests/00000003.json is a FIFO") as e:
        store.latest()
    assert e.value.version == 3
    fallback = store.latest(allow_fallback=True)
    assert fallback is not None and fallback.version == 2
    assert store.space().unreadable == (3,)


@_NO_HANG
def test_a_fifo_in_place_of_a_chunk_is_damage_not_a_hang(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    chunk = Path(store.backend.path(store.manifest(3).arrays["w"].path)) / "c.0"
    assert chunk.exists()
    _fifo_at(chunk)
    with pytest.raises(CorruptVersionError, match="not a regular file") as e:
        store.latest()
    assert e.value.version == 3
    fallback = store.latest(allow_fallback=True)
    assert fallback is not None and fallback.version == 2


@_NO_HANG
def test_fifos_in_place_of_lease_files_and_secrets_are_refused_unread(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    store.put_secret("k", b"x" * 32)
    secret = Path(store.backend.path("secret/k"))
    _fifo_at(secret)
    with pytest.raises(UnsafeFileError, match="secret/k is a FIFO, not a regular file"):
        store.get_secret("k")
    beat = Path(store.backend.path(lease_heartbeat_path(1)))
    if beat.exists():
        beat.unlink()
    os.mkfifo(beat, 0o600)  # a damaged heartbeat: the record's own time counts
    assert current_holder(store.backend) is not None
    record = Path(store.backend.path(lease_path(1)))
    _fifo_at(record)
    with pytest.raises(DamagedLeaseError, match="leases/00000001.json is not a lease record"):
        acquire_lease(store.backend)
    assert acquire_lease(store.backend, takeover=True).generation == 2


def test_a_manifests_folder_linked_out_of_the_store_is_refused(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    outside = tmp_path / "elsewhere"
    os.rename(store.backend.path("manifests"), outside)
    os.symlink(outside, store.backend.path("manifests"))
    with pytest.raises(CorruptVersionError, match="version 3 .*outside the store") as e:
        store.latest()
    assert e.value.version == 3
    with pytest.raises(CorruptVersionError, match="every version is damaged"):
        store.latest(allow_fallback=True)
    one = Path(store.backend.path(manifest_path(3)))
    os.unlink(store.backend.path("manifests"))
    os.rename(outside, store.backend.path("manifests"))
    target = tmp_path / "planted.json"
    target.write_bytes(one.read_bytes())
    one.unlink()
    one.symlink_to(target)  # one manifest linked out: that version alone is refused
    with pytest.raises(CorruptVersionError, match="version 3 .*outside the store"):
        store.latest()
    fallback = store.latest(allow_fallback=True)
    assert fallback is not None and fallback.version == 2


# -- hostile lease records ------------------------------------------------------------


def _foreign_record(gen: int, renewed: float) -> bytes:
    return json.dumps(
        {
            "owner": f"elsewhere:1:{gen}",
            "generation": gen,
            "host": "another-host",
            "pid": 1,
            "proc_start": None,
            "acquired": "2026-01-01T00:00:00+00:00",
            "renewed": renewed,
            "expiry_s": 60.0,
        }
    ).encode()


def test_a_nested_lease_record_is_named_and_taken_over_on_request(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    acquire_lease(store.backend).release()
    path = Path(store.backend.path(lease_path(2)))
    path.write_text('{"generation": 2, "x": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(DamagedLeaseError, match="leases/00000002.json is not a lease record"):
        acquire_lease(store.backend)
    with pytest.raises(StoreError, match="--takeover"):
        current_holder(store.backend)
    assert acquire_lease(store.backend, takeover=True).generation == 3


def test_a_heartbeat_renewed_in_the_far_future_does_not_block_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    backend = store.backend
    backend.makedirs("leases")
    backend.create_once(lease_path(1), _foreign_record(1, time.time() - 3600))
    backend.replace(
        lease_heartbeat_path(1), json.dumps({"generation": 1, "renewed": 1e308}).encode()
    )
    with caplog.at_level(logging.WARNING, logger="state.lease"):
        lease = acquire_lease(backend)
    assert lease.generation == 2
    lease.release()
    # the record itself claims the far future: no believable renewal, so not alive
    backend.create_once(lease_path(3), _foreign_record(3, 1e308))
    with caplog.at_level(logging.WARNING, logger="state.lease"):
        assert acquire_lease(backend).generation == 4
    assert "no believable renewal time (1e+308" in caplog.text
    # nor does an expiry no writer would choose: a week at most is believed
    week_ago = json.loads(_foreign_record(5, time.time() - 8 * 24 * 3600))
    week_ago["expiry_s"] = 1e308
    backend.create_once(lease_path(5), json.dumps(week_ago).encode())
    holder = current_holder(backend)
    assert holder is not None and holder["expires"] < time.time()
    assert acquire_lease(backend).generation == 6


def test_a_planted_generation_beyond_a_gap_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    backend = store.backend
    acquire_lease(backend).release()
    far = 10**15
    backend.create_once(lease_path(far), _foreign_record(far, time.time()))
    Path(backend.path("leases/" + "9" * 200 + ".json")).write_bytes(_foreign_record(9, 0.0))
    with caplog.at_level(logging.WARNING, logger="state.lease"):
        lease = acquire_lease(backend)
    assert lease.generation == 2
    assert f"ignoring lease record {lease_path(far)}" in caplog.text
    assert not lease.taken_over()


def test_lease_warnings_never_show_a_negative_duration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A holder on this host whose process is gone, its lease not yet expired: taken at
    once, and the warning says so instead of "expired -59 s ago"."""
    store = Store.open(str(tmp_path / "s.zarr"))
    backend = store.backend
    rec = json.loads(_foreign_record(1, time.time()))
    rec.update(host=this_host(), pid=2**22 + 12345, proc_start=1.0)  # no such process
    backend.makedirs("leases")
    backend.create_once(lease_path(1), json.dumps(rec).encode())
    with caplog.at_level(logging.WARNING, logger="state.lease"):
        assert acquire_lease(backend).generation == 2
    assert "is gone (its process ended" in caplog.text
    assert " -" not in caplog.text.replace(" -- ", "")


def test_manifest_from_bytes_still_reads_what_it_wrote(tmp_path: Path) -> None:
    store = _three_versions(tmp_path / "s.zarr")
    m = store.manifest(3)
    assert Manifest.from_bytes(m.to_bytes(), version=3, where="x").records == m.records


@_NO_HANG
def test_a_fifo_chunk_of_an_array_zarr_reads_itself_is_refused(tmp_path: Path) -> None:
    """An array whose zarr.json is not this library's layout is read by zarr, which
    opens chunks plainly: a FIFO among them is refused before zarr sees it."""
    store = _three_versions(tmp_path / "s.zarr")
    folder = Path(store.backend.path(store.manifest(3).arrays["w"].path))
    meta = json.loads((folder / "zarr.json").read_text())
    meta["attributes"] = {"planted": True}
    meta["codecs"] = meta["codecs"][:1]  # not the expected codecs: zarr reads it
    (folder / "zarr.json").write_text(json.dumps(meta))
    _fifo_at(folder / "c.0")
    group, name = array_group(store.manifest(3).arrays["w"].path)
    with pytest.raises(ValueError, match="c.0 is not a regular file"):
        read_array(store.backend, group, name)


def test_a_conflicting_hostile_manifest_is_named_a_conflict(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "s.zarr"))
    store.acquire_lease()
    txn = store.begin(1)
    txn.put_array("w", np.zeros(2))
    Path(store.backend.path(manifest_path(1))).write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(CommitConflictError, match="committed by another writer \\(unknown\\)"):
        txn.commit()


def test_a_deeply_nested_root_is_not_a_store(tmp_path: Path) -> None:
    root = tmp_path / "s.zarr"
    root.mkdir()
    (root / "zarr.json").write_text('{"attributes": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(NotAStoreError, match="not a cocoon-ckpt store root"):
        Store.open(str(root))
    assert sorted(p.name for p in root.iterdir()) == ["zarr.json"]
