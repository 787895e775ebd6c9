"""`SizeCheck` accepts a tape exactly when `merge(merged, tape)` does, and tells apart
what `==` alone would not (1 vs 1.0 vs True, 0.0 vs -0.0) where an op takes a Scalar."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cocoon_ckpt.train.size_check import SizeCheck
from cocoon_ckpt.train.tape import MergeError, Op, Recorder, Ref, Tape, merge

view = torch.ops.aten.view.default
mul = torch.ops.aten.mul.Scalar
clamp = torch.ops.aten.clamp.default
full = torch.ops.aten.full.default


def _tape(n: int, shape: list[int], scale: Any = 2.0, top: Any = 1.0, fill: Any = 0) -> Tape:
    ops = [
        Op(view, (Ref("in", 0), shape), {}, 1, None),
        Op(mul, (Ref("op", 0), scale), {}, 1, None),
        Op(clamp, (Ref("op", 1), None, top), {}, 1, None),
        Op(full, ([n, 3], fill), {"dtype": torch.float32}, 1, None),
    ]
    return Tape(ops, [], (Ref("op", 2), Ref("op", 3)), n)


def _accepts_by_merge(merged: Tape, tape: Tape) -> bool:
    try:
        merge(merged, tape)
    except MergeError:
        return False
    return True


MERGED = merge(_tape(5, [5, 3, 15]), _tape(7, [7, 3, 21]))


@given(
    n=st.integers(1, 40),
    shape=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    scale=st.sampled_from([2.0, 2, True, 1.0, -0.0, 0.0]),
    top=st.sampled_from([1.0, 1, None, float("inf")]),
    fill=st.sampled_from([0, 0.0, -0.0, False]),
)
def test_size_check_agrees_with_merge(
    n: int, shape: list[int], scale: Any, top: Any, fill: Any
) -> None:
    tape = _tape(n, shape, scale, top, fill)
    merge_says = _accepts_by_merge(MERGED, tape)
    check_says = SizeCheck(MERGED).mismatch(tape) is None
    if merge_says and not check_says:
        # the one difference allowed: the check tells -0.0 from 0.0, merge does not
        assert "-0.0" in str(SizeCheck(MERGED).mismatch(tape))
    else:
        assert merge_says == check_says


def test_size_check_accepts_the_merged_tape_at_every_size() -> None:
    for n in (1, 2, 5, 7, 64):
        assert SizeCheck(MERGED).mismatch(_tape(n, [n, 3, 3 * n])) is None


def test_size_check_refuses_loose_types_and_signed_zeros() -> None:
    check = SizeCheck(MERGED)
    assert check.mismatch(_tape(9, [9, 3, 27])) is None
    assert "at n=9" in str(check.mismatch(_tape(9, [9, 3, 27], scale=2)))  # int, not float
    assert check.mismatch(_tape(9, [9, 3, 27], top=1)) is not None
    assert check.mismatch(_tape(9, [9, 3, 27], fill=-0.0)) is not None
    assert check.mismatch(_tape(9, [9, 3, 27], fill=False)) is not None
    assert check.mismatch(_tape(9, [9, 3, 28])) is not None
    zero = merge(_tape(5, [5, 3, 15], scale=0.0), _tape(7, [7, 3, 21], scale=0.0))
    assert _accepts_by_merge(zero, _tape(9, [9, 3, 27], scale=-0.0))  # merge cannot tell
    assert SizeCheck(zero).mismatch(_tape(9, [9, 3, 27], scale=-0.0)) is not None
    with pytest.raises(ValueError, match="merged tape"):
        SizeCheck(_tape(9, [9]))


def test_size_check_on_recorded_tapes_of_a_real_chunk() -> None:
    """Tapes the recorder makes of a vmapped per-sample gradient: every size is the
    merged tape at that size, as merge says."""
    from torch.func import grad, vmap

    w = torch.randn(4, 3)

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).square().sum() * 0.5

    fn = vmap(grad(loss), in_dims=(None, 0))

    def record(n: int) -> Tape:
        x = torch.randn(n, 4)
        rec = Recorder([w, x])
        with rec:
            out = fn(w, x)
        return rec.tape(out, n)

    merged = merge(record(3), record(5))
    check = SizeCheck(merged)
    for n in (1, 2, 4, 8, 33):
        tape = record(n)
        assert (check.mismatch(tape) is None) == _accepts_by_merge(merged, tape)
        assert check.mismatch(tape) is None
