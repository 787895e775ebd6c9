"""A tape of the aten ops a call dispatches below torch.func's transforms, and the
merge of two tapes of different chunk sizes into one whose sizes are expressions of n.

`train.traced_grads` says why (replaying a chunk's tape skips the transforms' Python
work) and how a merged tape is checked before it serves a chunk size.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MergeError", "Op", "Recorder", "Ref", "Size", "Tape", "merge"]

_REFUSED_TAGS = {
    torch.Tag.nondeterministic_seeded: "draws random numbers (dropout in training mode?)",
    torch.Tag.data_dependent_output: "reads a tensor's value in Python (.item(), an if on a tensor)",
    torch.Tag.dynamic_output_shape: "makes a tensor whose shape depends on data",
}


class Ref(NamedTuple):
    """A tensor on a tape: input `at` (kind "in"), output `item` of op `at` (kind
    "op"), or constant `at` (kind "const")."""

    kind: str
    at: int
    item: int = 0


class Size(NamedTuple):
    """An integer argument that is `factor` times the chunk size."""

    factor: int


class Op(NamedTuple):
    op: torch._ops.OpOverload
    args: Any
    kwargs: Any
    outputs: int
    """Number of tensors the op returns (flattened)."""
    spec: Any
    """How they nest (a pytree spec)."""


class Tape(NamedTuple):
    """The ops one chunk dispatched, over its inputs; `n` its size."""

    ops: list[Op]
    constants: list[torch.Tensor]
    result: Any
    n: int


class MergeError(Exception):
    """Two tapes differ in more than their chunk size (the message says where)."""


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every aten op dispatched below the transforms while it is entered.

    Args:
        inputs: the tensors the recorded call takes (matched by identity).

    Tensors are known by id; an op's output is forgotten when it is freed (a weakref
    callback, run before its memory can be reused), so the recorded chunk frees its
    intermediates as the eager one does and no two tensors are confused.
    """

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._refs: dict[int, Ref] = {id(t): Ref("in", i) for i, t in enumerate(inputs)}
        self._alive: list[Any] = list(inputs)  # and constants: the tape holds them
        self._watch: dict[int, weakref.ref[torch.Tensor]] = {}
        self._of_inputs = {id(t) for t in inputs}  # inputs and views of them
        self.ops: list[Op] = []
        self.constants: list[torch.Tensor] = []
        self.refusal: str | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.refusal is not None:
            return out
        self.refusal = self._refuse(func, args, kwargs)
        template = tree_map(self._ref, (args, kwargs))
        flat, spec = tree_flatten(out)
        # None stands for a gradient not asked for (native_layer_norm_backward)
        if not all(t is None or isinstance(t, torch.Tensor) for t in flat):
            self.refusal = self.refusal or f"{func} returns a value Python reads"
        view_of_input = func.is_view and any(
            id(t) in self._of_inputs for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)
        )
        for j, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                key = id(t)
                if key not in self._watch:
                    self._watch[key] = weakref.ref(t, functools.partial(self._forget, key))
                self._refs[key] = Ref("op", len(self.ops), j)
                if view_of_input:
                    self._of_inputs.add(key)
        self.ops.append(Op(func, template[0], template[1], len(flat), spec))
        return out

    def _forget(self, key: int, _: object = None) -> None:
        self._refs.pop(key, None)
        self._watch.pop(key, None)
        self._of_inputs.discard(key)

    def _refuse(self, func: Any, args: Any, kwargs: dict[str, Any]) -> str | None:
        for tag, why in _REFUSED_TAGS.items():
            if tag in func.tags:
                return f"the model {why}: {func}"
        if func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                if (
                    arg.is_write
                    and isinstance(value, torch.Tensor)
                    and id(value) in self._of_inputs
                ):
                    # a replay checked against eager would apply the write twice
                    return f"the model writes to a parameter, buffer or input in place: {func}"
        return None

    def _ref(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        ref = self._refs.get(id(x))
        if ref is None:  # made outside any op (torch.tensor(...) in forward): a constant
            ref = self._refs[id(x)] = Ref("const", len(self.constants))
            self.constants.append(x)
            self._alive.append(x)
        return ref

    def tape(self, result: Any, n: int) -> Tape:
        """The tape of the call that returned `result` on a chunk of n examples."""
        return Tape(self.ops, self.constants, tree_map(self._ref, result), n)


def merge(a: Tape, b: Tape) -> Tape:
    """One tape whose integers that differ between `a` and `b` are `Size(c)` (c * n).

    `a` may be a merged tape (n = 0): then `b` must be it at b.n, and it is returned.

    Raises:
        MergeError: the tapes differ in ops, tensors, constants, or an integer that is
            not c * n in both.
    """
    if a.n == b.n:
        raise MergeError(f"both tapes are of size {a.n}")
    if len(a.ops) != len(b.ops):
        raise MergeError(f"{len(a.ops)} ops at n={a.n} but {len(b.ops)} at n={b.n}")
    if len(a.constants) != len(b.constants):
        raise MergeError("the tapes hold different numbers of constants")
    for i, (x, y) in enumerate(zip(a.constants, b.constants, strict=True)):
        same = x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
        if not same or not torch.equal(x, y):
            raise MergeError(f"constant {i} depends on the chunk")

    def both(x: Any, y: Any, where: str) -> Any:
        if isinstance(x, Size):
            if type(y) is not int or y != x.factor * b.n:
                raise MergeError(f"{where}: {y!r} at n={b.n} where the merged tape has {x}")
            return x
        if isinstance(x, Ref):
            if x != y:
                raise MergeError(f"{where}: {x} at n={a.n} but {y} at n={b.n}")
            return x
        if isinstance(x, list | tuple):
            if type(x) is not type(y) or len(x) != len(y):
                raise MergeError(f"{where}: {x!r} at n={a.n} but {y!r} at n={b.n}")
            return type(x)(both(u, v, where) for u, v in zip(x, y, strict=True))
        if isinstance(x, dict):
            if not isinstance(y, dict) or x.keys() != y.keys():
                raise MergeError(f"{where}: {x!r} at n={a.n} but {y!r} at n={b.n}")
            return {k: both(x[k], y[k], where) for k in x}
        if type(x) is int and type(y) is int and x != y and a.n > 0:
            c = x // a.n
            if c * a.n != x or c * b.n != y:
                raise MergeError(f"{where}: {x} at n={a.n} but {y} at n={b.n} is not c * n")
            return Size(c)
        if type(x) is not type(y) or x != y:
            raise MergeError(f"{where}: {x!r} at n={a.n} but {y!r} at n={b.n}")
        return x

    ops = []
    for k, (u, v) in enumerate(zip(a.ops, b.ops, strict=True)):
        where = f"op {k} ({u.op})"
        if u.op != v.op or u.outputs != v.outputs or u.spec != v.spec:
            raise MergeError(f"{where}: {v.op} at n={b.n}")
        args, kwargs = both(u.args, v.args, where), both(u.kwargs, v.kwargs, where)
        ops.append(Op(u.op, args, kwargs, u.outputs, u.spec))
    return Tape(ops, a.constants, both(a.result, b.result, "the result"), 0)
