"""Manifest MACs (format 4): any edit a writer without the key can make, re-stamping
the unkeyed checksums, is refused by name; an unedited manifest authenticates; a
manifest's MACs say nothing under another key."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from state import (
    ForgedVersionError,
    Manifest,
    UnauthenticatedVersionError,
    restamp,
)

KEY = bytes(range(32))

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_records = st.dictionaries(
    st.text(alphabet="abcdefghij_", min_size=1, max_size=8), _json, min_size=1, max_size=5
)


def _manifest(records: dict[str, Any], step: int = 3) -> Manifest:
    return Manifest(
        version=2,
        step=step,
        parent=1,
        created="2026-12-05T00:00:00+00:00",
        write_id="w" * 32,
        writer={"owner": "h:1:abc", "generation": 1},
        job_fingerprint="f" * 64,
        records=records,
    )


def _reread(data: bytes) -> Manifest:
    return Manifest.from_bytes(data, version=2, where="test")


@settings(max_examples=60, deadline=None)
@given(records=_records, data=st.data())
def test_an_edited_record_with_restamped_checksums_is_named(
    records: dict[str, Any], data: st.DataObject
) -> None:
    sealed, raw = _manifest(records).seal(KEY)
    again = _reread(raw)
    again.authenticate(KEY, where="test")
    assert again.sealed and again.macs == sealed.macs
    name = data.draw(st.sampled_from(sorted(records)))
    new = data.draw(_json.filter(lambda v: json.dumps(v) != json.dumps(records[name])))
    doc = json.loads(raw)
    doc["records"][name] = new
    forged = _reread(restamp(doc, keep_macs=True))  # the checksums verify
    with pytest.raises(ForgedVersionError) as e:
        forged.authenticate(KEY, where="test")
    assert (e.value.version, e.value.record) == (2, name)


@settings(max_examples=30, deadline=None)
@given(records=_records, step=st.integers(0, 10**6).filter(lambda s: s != 3))
def test_an_edited_header_is_named_and_stripped_macs_are_unauthenticated(
    records: dict[str, Any], step: int
) -> None:
    _, raw = _manifest(records).seal(KEY)
    doc = json.loads(raw)
    doc["step"] = step
    with pytest.raises(ForgedVersionError, match="the header") as e:
        _reread(restamp(doc, keep_macs=True)).authenticate(KEY, where="test")
    assert e.value.record == "header"
    stripped = _reread(restamp(doc))
    assert not stripped.sealed and stripped.step == step
    with pytest.raises(UnauthenticatedVersionError):
        stripped.authenticate(KEY, where="test")


def test_another_key_does_not_authenticate_and_sealing_is_deterministic() -> None:
    records = {"config": {"dp": {"noise_multiplier": 1.1}}, "accountant": {"steps": 2}}
    a = _manifest(records).seal(KEY)[1]
    assert a == _manifest(records).seal(KEY)[1]
    with pytest.raises(ForgedVersionError):
        _reread(a).authenticate(bytes(32), where="test")
    # a record moved under another name, MACs moved with it, is still refused: a
    # record's MAC covers its name
    doc = json.loads(a)
    doc["records"]["accountant2"] = doc["records"].pop("accountant")
    doc["record_macs"]["accountant2"] = doc["record_macs"].pop("accountant")
    with pytest.raises(ForgedVersionError, match="'accountant2'"):
        _reread(restamp(doc, keep_macs=True)).authenticate(KEY, where="test")


def test_format_3_manifests_still_read_without_a_key() -> None:
    old = dataclasses.replace(_manifest({"a": 1}), format_version=3)
    again = _reread(old.to_bytes())
    assert again.format_version == 3 and not again.sealed and again.records == {"a": 1}
