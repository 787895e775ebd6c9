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


def _integer_index(func: Any, args: Any) -> bool:
    """`x[i, j]` with integer index tensors (`aten.index.Tensor`, tagged as shaped by
    data for the sake of boolean masks): its shape is the indices' broadcast shape, so
    it replays like any op; a boolean or byte index (a mask) stays refused. The DLRM
    interaction's `z[:, rows, cols]` of `triu_indices` is one."""
    if func is not torch.ops.aten.index.Tensor:
        return False
    indices = args[1] if len(args) > 1 else ()
    return all(
        i is None or (isinstance(i, torch.Tensor) and i.dtype in (torch.int64, torch.int32))
        for i in indices
    )


#: the spec of a single tensor output (most ops'), built once
_LEAF = tree_flatten(torch.empty(0))[1]
#: argument types that are leaves for pytree as for the recorder
_LEAVES = frozenset(
    {
        int,
        float,
        bool,
        str,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
    }
)


class _OpKind(NamedTuple):
    """What the recorder needs of an op, read once per op (schema reads cross into C++)."""

    refusal: str | None
    """Why the op cannot be replayed whatever its arguments (a refused tag)."""
    writes: tuple[tuple[int, str], ...]
    """(position, name) of the arguments it writes in place."""
    is_view: bool

    @classmethod
    def of(cls, func: Any) -> _OpKind:
        refusal = next((why for tag, why in _REFUSED_TAGS.items() if tag in func.tags), None)
        writes: tuple[tuple[int, str], ...] = ()
        if func._schema.is_mutable:
            writes = tuple((i, a.name) for i, a in enumerate(func._schema.arguments) if a.is_write)
        return cls(refusal, writes, bool(func.is_view))


#: per op (an OpOverload lives as long as the process), what the recorder reads of it
_KINDS: dict[Any, _OpKind] = {}


def _leaves(x: Any) -> list[Any]:
    """The leaves of an op's arguments (lists and tuples walked; `_template` says why)."""
    t = type(x)
    if t is list or t is tuple:
        return [v for y in x for v in _leaves(y)]
    if isinstance(x, torch.Tensor) or t in _LEAVES:
        return [x]
    return list(tree_flatten(x)[0])


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

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps a subclass's __torch_dispatch__ in a frame that turns
        # dynamo off (0.3-0.6 ms of a 104-op chunk's recording); nothing here compiles
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # the C++ entry point, as OpOverload.__call__ calls it (one Python frame less).
        # `_op` is private to torch (2.x's OpOverload): a release that renames it breaks
        # here at the first recorded op, and `func(*args, **kwargs)` is the public call
        out = func._op(*args, **kwargs)
        if self.refusal is not None:
            return out
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _OpKind.of(func)
        if kind.refusal is not None and not _integer_index(func, args):
            self.refusal = f"the model {kind.refusal}: {func}"
        elif kind.writes:
            self.refusal = self._writes_input(func, kind.writes, args, kwargs)
        template = (
            self._template(args),
            {k: self._template(v) for k, v in kwargs.items()} if kwargs else {},
        )
        if isinstance(out, torch.Tensor):
            flat: list[Any] = [out]
            spec = _LEAF
        else:
            flat, spec = tree_flatten(out)
        # None stands for a gradient not asked for (native_layer_norm_backward)
        if not all(t is None or isinstance(t, torch.Tensor) for t in flat):
            self.refusal = self.refusal or f"{func} returns a value Python reads"
        view_of_input = kind.is_view and any(
            isinstance(t, torch.Tensor) and id(t) in self._of_inputs for t in _leaves(args)
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

    def _writes_input(
        self, func: Any, writes: tuple[tuple[int, str], ...], args: Any, kwargs: dict[str, Any]
    ) -> str | None:
        for i, name in writes:
            value = args[i] if i < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor) and id(value) in self._of_inputs:
                # a replay checked against eager would apply the write twice
                return f"the model writes to a parameter, buffer or input in place: {func}"
        return None

    def _template(self, x: Any) -> Any:
        """`tree_map(self._ref, x)` over an op's argument. aten passes lists, tuples and
        leaves, walked here directly; any other container goes to pytree. pytree's
        general walk (a node-type lookup per value) was most of the recorder's own time:
        recording a 60-example chunk of bench/dp_step.py's mlp took 13.9 ms (eager 3.3),
        7.7 ms with this walk and `_KINDS` (median of 7, one thread, loaded 2-core box)."""
        t = type(x)
        if t is list:
            return [self._template(v) for v in x]
        if t is tuple:
            return tuple([self._template(v) for v in x])
        if isinstance(x, torch.Tensor):
            return self._refs.get(id(x)) or self._ref(x)
        if t in _LEAVES:
            return x
        return tree_map(self._ref, x)

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
