"""state.canonical_json writes exactly the text of json.dumps(sort_keys=True, indent=1),
which a manifest's canonical bytes are defined by (readers compare the stored bytes)."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from state.canonical_json import canonical_text
from state.manifest import ArrayMeta, Manifest

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_docs = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=40,
)


def _reference(doc: object) -> str:
    return json.dumps(doc, sort_keys=True, indent=1)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _docs, max_size=6))
def test_same_text_as_json_dumps(doc: dict[str, object]) -> None:
    assert canonical_text(doc) == _reference(doc)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=False, allow_infinity=False)
        | st.integers()
        | st.booleans()
        | st.none(),
        max_size=50,
    ),
    st.integers(0, 3),
)
def test_number_lists_at_any_depth(items: list[object], depth: int) -> None:
    doc: object = items
    for i in range(depth):
        doc = {f"k{i}": doc, "s": "a, b"}
    wrapped = {"x": doc, "y": [items, "c, d", [items]]}
    assert canonical_text(wrapped) == _reference(wrapped)


def test_other_types_fall_back_to_json() -> None:
    doc: dict[str, object] = {
        "t": (1, 2.5),
        "d": {"a": {1: "x", 2: "y"}},
        "e": {},
        "l": [],
        "n": [[], {}],
    }
    assert canonical_text(doc) == _reference(doc)


def test_a_manifest_with_a_long_metrics_curve_round_trips() -> None:
    rng = np.random.default_rng(0)
    values = {
        name: {"steps": [[0, 1500]], "values": [float(v) for v in rng.random(1500) * 10]}
        for name in ("loss", "grad_norm", "noise_norm")
    }
    m = Manifest(
        version=7,
        step=1500,
        parent=6,
        created="2026-12-04T00:00:00Z",
        write_id="abc",
        writer={"owner": "w", "generation": 1},
        job_fingerprint="sha256:" + "0" * 64,
        arrays={
            f"ring/{i}": ArrayMeta(
                path=f"versions/00000007-g1/r{i}",
                shape=(3, 4),
                dtype="float32",
                checksum="crc32c:1",
                chunks=(3, 4),
            )
            for i in range(20)
        },
        records={"metrics": {"schema_version": 1, "series": values}, "x": {"big": 1e308}},
    )
    data = m.to_bytes()
    doc: dict[str, object] = json.loads(data)
    assert data == _reference(doc).encode()
    assert (
        Manifest.from_bytes(data, version=7, where="mem://t").records["metrics"]
        == m.records["metrics"]
    )
