"""Whether a recorded tape is a merged tape at its chunk size, checked op for op.

`train.traced_grads` records the first chunk of every new size and lets the merged
tape serve that size only if the recording is the merged tape at that size; this is
that check, the same verdict as `train.tape.merge` without building a merged copy.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cocoon_ckpt.train.tape import Size, Tape

__all__ = ["SizeCheck"]

#: schema types whose Python value may change type (int, float, bool) or sign of zero
#: from call to call; an argument of any other type arrives as its schema's one type
_LOOSE_TYPES = ("number", "float", "Any", "complex")


def _loose(op: Any) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The positions and names of `op`'s arguments that `==` alone cannot compare
    (1 == 1.0 == True, 0.0 == -0.0): Scalars, floats, complex numbers, Any."""
    args = op._schema.arguments
    loose = [(i, a) for i, a in enumerate(args) if any(t in str(a.type) for t in _LOOSE_TYPES)]
    return tuple(i for i, a in loose if not a.kwarg_only), tuple(a.name for _, a in loose)


def _has_size(x: Any) -> bool:
    if isinstance(x, Size):
        return True
    if isinstance(x, list | tuple):
        return any(_has_size(v) for v in x)
    if isinstance(x, dict):
        return any(_has_size(v) for v in x.values())
    return False


class SizeCheck:
    """Whether a tape is a merged tape at its size: what `merge(merged, tape)` accepts,
    without building the merged copy, and with floats told apart by sign of zero.

    Args:
        merged: a merged tape (n = 0).

    `merge` walks every argument of every op in Python; here an op's arguments are
    compared by one `==` of their lists (instantiated at n where they hold a `Size`),
    which is exact where the schema fixes a value's Python type (int, bool, dtype, a
    tensor's `Ref`), and the loosely typed ones (Scalar, float) leaf by leaf. On the
    mlp tape of bench/dp_step.py (106 ops) a check took 0.8-1.6 ms by `merge` and
    0.18-0.35 ms here (thread CPU time, one thread, loaded 2-core box).
    """

    def __init__(self, merged: Tape) -> None:
        if merged.n != 0:
            raise ValueError(
                f"SizeCheck got a tape of size {merged.n}: it takes a merged tape (n = 0), "
                "the result of merge(a, b)"
            )
        self.merged = merged
        kinds: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {}
        #: per op, the loose arguments it passes: (position or keyword, merged value)
        self._loose: list[tuple[tuple[int | str, Any], ...]] = []
        for op in merged.ops:
            loose = kinds.get(op.op)
            if loose is None:
                loose = kinds[op.op] = _loose(op.op)
            at: list[tuple[int | str, Any]] = [
                (i, op.args[i]) for i in loose[0] if i < len(op.args)
            ]
            at += [(k, op.kwargs[k]) for k in loose[1] if k in op.kwargs]
            self._loose.append(tuple(at))
        # only the ops whose arguments hold a size are rebuilt at n (compiling all of
        # them cost 4-5 ms a tape); the others are compared as they are
        sized = [k for k, op in enumerate(merged.ops) if _has_size((op.args, op.kwargs))]
        self._at = _instantiator({k: (merged.ops[k].args, merged.ops[k].kwargs) for k in sized})

    def mismatch(self, tape: Tape) -> str | None:
        """None when `tape` is the merged tape at `tape.n` op for op, else where not."""
        a, n = self.merged, tape.n
        if len(a.ops) != len(tape.ops):
            return f"{len(a.ops)} ops in the merged tape but {len(tape.ops)} at n={n}"
        if len(a.constants) != len(tape.constants):
            return "the tapes hold different numbers of constants"
        for i, (x, y) in enumerate(zip(a.constants, tape.constants, strict=True)):
            same = x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
            if not same or not torch.equal(x, y):
                return f"constant {i} depends on the chunk"
        for k, (u, v) in enumerate(zip(a.ops, tape.ops, strict=True)):
            if (
                u.op is not v.op
                or u.outputs != v.outputs
                or (u.spec is not v.spec and u.spec != v.spec)
            ):
                return f"op {k} ({u.op}): {v.op} at n={n}"
        want = self._at(n)
        for k, (u, v, loose) in enumerate(zip(a.ops, tape.ops, self._loose, strict=True)):
            args, kwargs = want.get(k, (u.args, u.kwargs))
            # equal lists of equal length: the loose arguments sit at the same places
            if (
                args != v.args
                or kwargs != v.kwargs
                or not all(
                    _equal(x, v.args[i] if type(i) is int else v.kwargs[i], n) for i, x in loose
                )
            ):
                return f"op {k} ({v.op}): {v.args!r} {v.kwargs!r} at n={n}"
        if not _equal(a.result, tape.result, n):
            return f"the result: {tape.result!r} at n={n}"
        return None


def _instantiator(values: Any) -> Any:
    """A function of n that builds `values` with each `Size(c)` replaced by c * n: one
    generated expression of list, tuple and dict displays, every other leaf by
    reference (a Python walk per check cost 3-4x more)."""
    scope: dict[str, Any] = {}

    def src(x: Any) -> str:
        if isinstance(x, Size):
            return f"({x.factor} * n)"
        if type(x) is list:
            return "[" + "".join(f"{src(v)}, " for v in x) + "]"
        if type(x) is tuple:
            return "(" + "".join(f"{src(v)}, " for v in x) + ")"
        if type(x) is dict:
            return "{" + "".join(f"{src(k)}: {src(v)}, " for k, v in x.items()) + "}"
        if type(x) in (int, bool, str, type(None)):
            return repr(x)
        key = f"v{len(scope)}"
        scope[key] = x
        return key

    code = f"def at(n):\n    return {src(values)}\n"
    exec(compile(code, "<cocoon_ckpt size check>", "exec"), scope)  # noqa: S102
    return scope["at"]


def _equal(x: Any, y: Any, n: int) -> bool:
    """`x` (of a merged tape) is `y` at n, leaf by leaf, types and the sign of zero
    included (NaN is unequal, as in `merge`)."""
    if isinstance(x, Size):
        return type(y) is int and y == x.factor * n
    if type(x) is not type(y):
        return False
    if isinstance(x, list | tuple):
        return len(x) == len(y) and all(_equal(u, v, n) for u, v in zip(x, y, strict=True))
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k], n) for k in x)
    if type(x) is float:
        return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)
    return bool(x == y)
