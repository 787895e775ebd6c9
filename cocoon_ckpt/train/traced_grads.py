"""A chunk's clipped sum replayed from the aten ops it dispatched, for any chunk size.

`torch.func.vmap(grad(...))` rebuilds its wrappers (batched and grad-tracking tensors,
pytrees, functional_call's parameter swap) on every call: on the small MLPs of
bench/dp_step.py that Python work is most of a DP step. Below the transforms it
dispatches plain aten ops on plain tensors; a TorchDispatchMode sees exactly those (as
make_fx does), so a chunk computed under `Recorder` leaves a tape of them, and replaying
the tape calls the same kernels on the same shapes, hence gives the same bits, without
the wrappers.

A tape holds the chunk size n in its shape arguments (`view(x, [n, 64])`), and a Poisson
batch changes size every step. So two real chunks of different sizes are recorded, and
their tapes merged into one graph whose size-dependent integers are expressions of an
input n: an integer that differs between the tapes must be c * n in both (same c);
every other argument must agree. The user's model never sees n under vmap, so only the
transforms' shape arguments can depend on it; anything else refuses the merge.

make_fx would record the same ops, but each size apart (0.6-0.8 s a size measured on
the shared 2-core box, some 50 sizes at batch 64) and it loads sympy and the fake-tensor
machinery on first use (6-9 s there); the recorder costs one chunk run under the mode.
Measured on a digits-sized MLP (64-64-10, chunks of 20, one thread), a replayed chunk
takes 0.3-0.5x the eager chunk's time, same bits.

Each size is checked once before the merged tape serves it: its first chunk runs
eagerly under the recorder, and its tape must be the merged one at that size, op for
op (`train.size_check`; else that size stays eager), and the replay's bits the eager ones (else, logged,
the eager path serves every chunk from then on), as it does for what cannot be
replayed: random ops (dropout in training mode), ops whose result Python reads
(`.item()`, data-dependent control flow) or whose shape depends on data (`nonzero`),
in-place writes to the parameters, buffers or data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from cocoon_ckpt.train.size_check import SizeCheck
from cocoon_ckpt.train.tape import MergeError, Recorder, Ref, Size, Tape, merge

__all__ = ["ChunkFn", "TracedChunk", "compile_tape"]

log = logging.getLogger(__name__)

#: flat inputs (parameters, buffers, chunk tensors) -> (clipped sum (dim,), losses (n,),
#: per-sample gradient norms (n,))
ChunkFn = Callable[..., tuple[torch.Tensor, ...]]


def compile_tape(tape: Tape, inputs: int) -> Callable[..., Any]:
    """The merged tape as one Python function f(*inputs, n) -> the result.

    Each op is called through its C++ entry point (`OpOverload._op`: the same kernel
    without OpOverload.__call__'s Python frame), a value is dropped after its last use
    (the eager path frees as it goes too), and ops whose outputs nothing reads are left
    out (a tape's ops are pure once random and in-place-input ops are refused; in-place
    ops on intermediates are kept).
    """
    live = _live_ops(tape)
    names: dict[Ref, str] = {Ref("in", i): f"x{i}" for i in range(inputs)}
    names.update({Ref("const", i): f"c{i}" for i in range(len(tape.constants))})
    scope: dict[str, Any] = {f"c{i}": c for i, c in enumerate(tape.constants)}
    lines = [f"def replay({''.join(f'x{i}, ' for i in range(inputs))}n):"]

    def src(x: Any) -> str:
        if isinstance(x, Ref):
            return names[x]
        if isinstance(x, Size):
            return "n" if x.factor == 1 else f"({x.factor} * n)"
        if isinstance(x, list):
            return "[" + "".join(f"{src(v)}, " for v in x) + "]"
        if isinstance(x, tuple):
            return "(" + "".join(f"{src(v)}, " for v in x) + ")"
        if isinstance(x, dict):
            return "{" + "".join(f"{k!r}: {src(v)}, " for k, v in x.items()) + "}"
        if isinstance(x, bool | int | str | type(None)) or (
            isinstance(x, float) and x == x and abs(x) != float("inf")
        ):
            return repr(x)
        key = f"k{len(scope)}"  # dtypes, devices, layouts, non-finite floats: by reference
        scope[key] = x
        return key

    last: dict[int, int] = {}  # op -> the last op that reads its outputs
    for k in sorted(live):
        for i in _refs_in((tape.ops[k].args, tape.ops[k].kwargs)):
            last[i] = k
    kept = set(_refs_in(tape.result))
    for k in sorted(live):
        op = tape.ops[k]
        if not op.spec.is_leaf() and any(not c.is_leaf() for c in op.spec.children()):
            raise MergeError(f"{op.op} returns nested outputs")
        scope[f"f{k}"] = op.op._op
        args = "".join(f"{src(v)}, " for v in op.args)
        kwargs = "".join(f"{name}={src(v)}, " for name, v in op.kwargs.items())
        lines.append(f"    o{k} = f{k}({args}{kwargs})")
        for j in range(op.outputs):
            names[Ref("op", k, j)] = f"o{k}" if op.spec.is_leaf() else f"o{k}[{j}]"
        done = [i for i in _refs_in((op.args, op.kwargs)) if last[i] == k and i not in kept]
        if done:
            lines.append(f"    del {', '.join(f'o{i}' for i in sorted(set(done)))}")
    lines.append(f"    return {src(tape.result)}")
    exec(compile("\n".join(lines), "<cocoon_ckpt replay>", "exec"), scope)  # noqa: S102
    replay: Callable[..., Any] = scope["replay"]
    return replay


def _live_ops(tape: Tape) -> set[int]:
    """Ops whose outputs the result needs, and every op that writes in place."""
    live: set[int] = set()
    needed = set(_refs_in(tape.result))
    for k in range(len(tape.ops) - 1, -1, -1):
        op = tape.ops[k]
        if k in needed or op.op._schema.is_mutable:
            live.add(k)
            for i in _refs_in((op.args, op.kwargs)):
                needed.add(i)
    return live


def _refs_in(x: Any) -> list[int]:
    """Indices of the ops whose outputs `x` refers to."""
    if isinstance(x, Ref):
        return [x.at] if x.kind == "op" else []
    if isinstance(x, Size):
        return []
    if isinstance(x, list | tuple):
        return [i for v in x for i in _refs_in(v)]
    if isinstance(x, dict):
        return [i for v in x.values() for i in _refs_in(v)]
    return []


class TracedChunk:
    """A chunk function served by its merged tape at the sizes checked against it.

    Args:
        eager: the chunk function (flat inputs, the chunk's tensors last -> result).

    The first chunks of two sizes are recorded and merged; the first chunk of every
    other size is recorded too and must be the merged tape at that size op for op
    (the same ops on the same shapes are the same kernels: the same bits for every
    input of that size), and its replay must give the eager bits (the code the tape
    became is right). A size whose ops differ (a kernel path special to it) runs
    eagerly. `reason` says why the eager path serves every chunk (None while it need
    not).
    """

    def __init__(self, eager: ChunkFn) -> None:
        self.eager = eager
        self.reason: str | None = None
        self.checked: set[int] = set()
        self.eager_sizes: set[int] = set()
        self._first: Tape | None = None
        self._merged: Tape | None = None
        self._check: SizeCheck | None = None
        self._replay: Callable[..., Any] | None = None

    @property
    def replaying(self) -> bool:
        """Whether the merged tape serves the sizes it was checked at."""
        return self._replay is not None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = int(inputs[-1].shape[0])
        if self._replay is not None and n in self.checked:
            out: tuple[torch.Tensor, ...] = self._replay(*inputs, n)
            return out
        first = self._first
        if self.reason is not None or n in self.eager_sizes or (first and first.n == n):
            return self.eager(*inputs)
        recorder = Recorder(inputs)
        with recorder:
            result = self.eager(*inputs)
        if recorder.refusal is not None:
            self._retire(recorder.refusal, logging.INFO)
            return result
        tape = recorder.tape(result, n)
        del recorder  # the chunk's intermediates
        if self._check is not None:
            differs = self._check.mismatch(tape)
            if differs is not None:
                self.eager_sizes.add(n)
                log.info("per-sample gradients of chunks of %d run eagerly: %s", n, differs)
                return result
            self._verify(inputs, n, result)
            return result
        try:
            if first is None:
                self._first = tape
                return result
            else:
                self._first = None
                self._merged = merge(first, tape)
                self._replay = compile_tape(self._merged, len(inputs))
                self._check = SizeCheck(self._merged)
        except MergeError as exc:
            self._retire(f"the tapes of two chunk sizes differ beyond n ({exc})", logging.INFO)
            return result
        self._verify(inputs, n, result)
        return result

    def _verify(self, inputs: Sequence[torch.Tensor], n: int, want: Any) -> None:
        """Replay size n and compare with the eager result bit for bit."""
        try:
            got = self._replay(*inputs, n) if self._replay is not None else None
            same = got is not None and all(
                _same_bits(u, v)
                for u, v in zip(tree_flatten(want)[0], tree_flatten(got)[0], strict=True)
            )
            why = "its bits differ from the eager path's"
        except Exception as exc:  # a replay that does not run is retired like a wrong one
            same, why = False, f"it raised {type(exc).__name__}: {exc}"
        if same:
            self.checked.add(n)
        else:
            self._retire(f"the replay at chunk size {n} was retired: {why}", logging.WARNING)

    def _retire(self, reason: str, level: int) -> None:
        self.reason, self._replay, self._first, self._merged = reason, None, None, None
        self._check = None
        log.log(level, "per-sample gradients run eagerly: %s", reason)


def _same_bits(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(a == b)
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point():
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
    return torch.equal(a, b)
