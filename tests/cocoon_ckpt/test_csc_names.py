"""`layout.csc_array` is the one parser of CSC array names: it inverts the names the
writers give (`emb_name(param, "csc/<array>")`, `csc_part_name`), and the two readers
that choose what to stream (`tools.csc_reads.csc_part`, `csc_window.read_in_windows`)
agree with it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt.embedding.csc_window import read_in_windows
from cocoon_ckpt.layout import csc_array, csc_part_name, emb_name, ring_rows_name
from cocoon_ckpt.tools.csc_reads import csc_part

params = st.text(alphabet="abcdefghij._/0123456789", min_size=1, max_size=12).filter(
    lambda p: not p.startswith("/") and not p.endswith("/") and "/csc" not in p
)
arrays = st.sampled_from(["col_ptr", "rows", "values"])


@given(params, arrays)
def test_a_one_process_cscs_names_parse_back(param: str, array: str) -> None:
    name = emb_name(param, f"csc/{array}")
    assert csc_array(name) == (param, None, array)
    assert csc_part(name) == (None if array == "col_ptr" else (param, array))
    assert read_in_windows(name) is (array != "col_ptr")


@given(params, st.integers(0, 10**9), st.integers(0, 10**9), arrays)
def test_a_ranks_part_names_parse_back(param: str, start: int, stop: int, array: str) -> None:
    name = csc_part_name(param, start, stop, array)
    assert csc_array(name) == (param, (start, stop), array)
    assert csc_part(name) is None  # the tools stream one-process CSCs only
    assert read_in_windows(name) is (array != "col_ptr")


def test_other_names_are_not_cscs() -> None:
    for name in [
        ring_rows_name(0, 1, 4),
        emb_name("t", "ring/w-00000001-00000002"),
        emb_name("t", "csc/slots-3/rows"),
        emb_name("t", "csc/slots-a-3/rows"),
        emb_name("t", "csc/other"),
        "emb//csc/rows",
        "model/csc/rows",
    ]:
        assert csc_array(name) is None, name
        assert csc_part(name) is None
        assert read_in_windows(name) is False
