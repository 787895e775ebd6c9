"""What a job is: the parts a builder returns, and the loader for `example:NAME` or a user's `module:function`."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils.data import Dataset

from cocoon_ckpt._state_dict import uncompiled
from cocoon_ckpt.embedding.config import TableSpec
from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.train.workers import DEFAULT_WORKER_TIMEOUT_S

__all__ = [
    "JobParts",
    "Stateful",
    "check_optimizer_step",
    "make_optimizer",
    "optimizer_class",
    "resolve",
]

_STATEFUL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@runtime_checkable
class Stateful(Protocol):
    """Anything whose state a checkpoint carries: EMA weights, a GradScaler, counters."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


@dataclass(frozen=True, slots=True)
class JobParts:
    """What a job builder returns: the model, its optimizer, loss and training data.

    `dataset` is the data's name; `data` is kept as its alias (builders written before
    Datasets were accepted): give one of them.

    Attributes:
        model: The model. A `torch.compile`d one is kept as the module it compiles (its `_orig_mod`,
            sharing its parameters), so stores and exports name parameters without the `_orig_mod.`
            prefix and a store resumes with or without compiling.
        optimizer: The optimizer over `model`'s parameters; its class and hyperparameters must be
            the ones `JobConfig.optimizer` and `JobConfig.lr` name.
        loss_fn: loss_fn(output, target) -> the batch's mean loss, a scalar tensor (e.g.
            `nn.functional.cross_entropy`); per-sample gradients are taken through it.
        data: Alias of `dataset`.
        tables: The model's embedding tables and where their ids are; used when the job config asks
            for embedding noise without naming tables.
        dataset: A map-style Dataset whose items are tuples (the last element is the target), or
            tensors indexed by example along dim 0 (the last is the target). Its `len()` is N.
        scheduler: A learning-rate scheduler of `optimizer`, stepped once per DP step after the
            optimizer's step; its state is in every version.
        stateful: Other state to checkpoint (EMA weights, a GradScaler, counters), by name (letters,
            digits, `_.-`): each `state_dict()` is saved in every version and loaded on resume.
            Tensors are stored as arrays, the rest as JSON.
        num_workers: DataLoader worker processes (batches are the same with any number).
        pin_memory: Pin each batch's tensors (for a copy to an accelerator).
        collate_fn: Turns a list of Dataset items into a tuple of tensors (default_collate if None).
        worker_timeout_s: Seconds a step waits for a worker's batch before the job names the
            worker (its pid; stopped, or stuck in a fetch), releases its lease and stops
            (exit 1); a dead worker is named at once. Default 300.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    data: Dataset[Any] | Sequence[torch.Tensor] | None = None
    tables: Sequence[TableSpec] = field(default_factory=tuple)
    dataset: Dataset[Any] | Sequence[torch.Tensor] | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    stateful: Mapping[str, Stateful] = field(default_factory=dict)
    num_workers: int = 0
    pin_memory: bool = False
    collate_fn: Callable[[list[Any]], Any] | None = None
    worker_timeout_s: float = DEFAULT_WORKER_TIMEOUT_S

    def __post_init__(self) -> None:
        # Per-sample gradients (torch.func.functional_call under vmap(grad(...))) gain
        # nothing from the compiled module: dynamo refuses to trace under a functorch
        # transform ("Unsupported functorch tracing attempt: calling torch.func.grad
        # (compiled_fn) from eager mode"), so the step runs eagerly anyway, measured 27%
        # slower than the plain module (3-layer MLP, 256 examples, CPU, torch 2.13) and
        # bit-identical to it. Train with the plain module, names without the prefix.
        object.__setattr__(self, "model", uncompiled(self.model))
        # both equal: dataclasses.replace passes both fields on
        given = {id(d): d for d in (self.data, self.dataset) if d is not None}
        if len(given) != 1:
            raise ConfigError(
                "JobParts: give the training data as dataset= (data= is its old name), "
                f"exactly once; got data={type(self.data).__name__}, "
                f"dataset={type(self.dataset).__name__}"
            )
        (data,) = given.values()
        object.__setattr__(self, "dataset", data)
        object.__setattr__(self, "data", data)
        sched = self.scheduler
        if sched is not None and getattr(sched, "optimizer", None) is not self.optimizer:
            raise ConfigError(
                f"JobParts.scheduler {type(sched).__name__} does not schedule "
                "JobParts.optimizer: build it over the job's optimizer"
            )
        for name, part in self.stateful.items():
            if not isinstance(name, str) or not _STATEFUL_NAME.fullmatch(name):
                raise ConfigError(
                    f"JobParts.stateful name {name!r} must be letters, digits, '_', '.' or '-'"
                )
            if not isinstance(part, Stateful):
                raise ConfigError(
                    f"JobParts.stateful[{name!r}] is a {type(part).__name__}, which has no "
                    "state_dict()/load_state_dict(): wrap it in an object that has both"
                )
        if self.num_workers < 0:
            raise ConfigError(f"JobParts.num_workers={self.num_workers} must be >= 0")
        timeout = self.worker_timeout_s
        if not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ConfigError(
                f"JobParts.worker_timeout_s={timeout!r} must be a finite number of seconds > 0"
            )


Builder = Callable[..., JobParts]


def resolve(job: str, *, search_cwd: bool = False) -> Builder:
    """The builder for `example:mlp`, `example:dlrm`, or `package.module:function`.

    A builder is called as `builder(config)` with the JobConfig and returns JobParts.

    Args:
        job: the job's name.
        search_cwd: find the module in the current directory first, as `python -m`
            would (the CLI's `train --job`: a user's `myjob.py` beside them). The
            directory is on `sys.path` only while the module is imported (with what it
            imports at its top), so no later import of a library can pick up a file of
            the same name from it. Only for a job the user named: never for a name a
            store records.

    Raises:
        ConfigError: the name is malformed, its module cannot be found or imported, or
            it has no callable of that name (a ValueError).
    """
    module, _, func = job.partition(":")
    if not module or not func:
        raise ConfigError(
            f"job {job!r} must be 'example:NAME' or 'module:function', e.g. myjob:build"
        )
    named_by_file = module.endswith(".py")  # explained where its import fails (_import)
    dotted = all(part.isidentifier() for part in module.split("."))
    if module != "example" and not named_by_file and not dotted:
        raise ConfigError(
            f"job {job!r}: {module!r} is not a module name (dotted Python identifiers, as "
            "import takes them); name a module importable from the current folder, e.g. "
            "myjob:build for myjob.py"
        )
    if module == "example":
        module = f"cocoon_ckpt.examples.{func}"
        func = "build"
        search_cwd = False  # ours, installed: nothing to find beside the user
    with _cwd_first(search_cwd) as where:
        mod = _import(job, module, where)
    builder = getattr(mod, func, None)
    if not callable(builder):
        found = sorted(n for n, v in vars(mod).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"job {job!r}: module {module} ({getattr(mod, '__file__', '?')}) has no "
            f"function {func!r}; name one of its callables ({', '.join(found[:8]) or 'none'})"
        )
    return builder  # type: ignore[no-any-return]


@contextlib.contextmanager
def _cwd_first(on: bool) -> Iterator[str]:
    """The current directory first on sys.path for the block (`on`), then gone again."""
    if not on:
        yield "on sys.path"
        return
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    # a directory listing cached before the user's file appeared would hide it
    importlib.invalidate_caches()
    try:
        yield f"in the current directory {cwd} or on sys.path"
    finally:
        # the user's module may have changed sys.path: take out our entry only
        if sys.path and sys.path[0] == cwd:
            del sys.path[0]
        elif cwd in sys.path:
            sys.path.remove(cwd)


def _import(job: str, module: str, where: str) -> Any:
    if module.startswith(".") and module.endswith(".py"):
        # `../myjob.py`: a relative import to Python, which raises TypeError without a package
        raise ConfigError(_file_not_module(job))
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module == missing or module.startswith(missing + "."):
            if module.endswith(".py") or "/" in module or os.sep in module:
                raise ConfigError(_file_not_module(job)) from None
            file = module.replace(".", "/") + ".py"
            hidden = _shadowed(module)
            if hidden is not None:
                raise ConfigError(
                    f"job {job!r}: cannot import module {module!r}: {hidden}"
                ) from None
            raise ConfigError(
                f"job {job!r}: cannot import module {module!r}: no {missing!r} {where}; "
                f"run from the folder that holds {file}, or install the package that "
                "provides it"
            ) from None
        raise ConfigError(
            f"job {job!r}: cannot import module {module!r}: it imports {missing!r}, which "
            "is not installed; install it"
        ) from None
    except ImportError as exc:
        raise ConfigError(
            f"job {job!r}: cannot import module {module!r} ({exc}); fix that import"
        ) from None


def _file_not_module(job: str) -> str:
    """What to write instead of a job named by its file (`myjob.py:build`), which no
    import finds: the module's name, and the folder to run from."""
    path, _, func = job.partition(":")
    folder, file = os.path.split(path)
    stem = file.removesuffix(".py")
    where = f"the folder {folder}, which holds {file}" if folder else f"the folder of {file}"
    return (
        f"job {job!r} names a file; name its module instead: {stem}:{func}, run from "
        f"{where} (a module in a package: package.{stem}:{func})"
    )


def _shadowed(module: str) -> str | None:
    """Why `module` was not found although the current directory holds its top-level
    folder: a regular package of that name elsewhere was imported instead (a folder
    without `__init__.py` is a namespace package, which any regular package of the same
    name on sys.path hides). None when that is not the case."""
    top = module.partition(".")[0]
    mod = sys.modules.get(top)
    folder = os.path.join(os.getcwd(), top)
    where = getattr(mod, "__file__", None)
    if mod is None or where is None or not os.path.isdir(folder):
        return None
    if os.path.dirname(os.path.abspath(where)) == os.path.abspath(folder):
        return None
    return (
        f"{top!r} was imported from {where}, another package of that name, which hides "
        f"the folder {folder}; add an empty {top}/__init__.py to your folder, or rename it"
    )


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The `torch.optim` optimizer class named `name` in lower case (`sgd`, `adam`, ...;
    `JobConfig.optimizer`).

    Raises:
        ConfigError: torch.optim has no optimizer of that name (`custom` included: a
            job's own class is built by the job).
    """
    classes = {
        n.lower(): c
        for n, c in vars(torch.optim).items()
        if isinstance(c, type)
        and issubclass(c, torch.optim.Optimizer)
        and c is not torch.optim.Optimizer
    }
    if name not in classes:
        raise ConfigError(
            f"JobConfig.optimizer={name!r}: torch.optim has no such optimizer; use one of "
            f"{sorted(classes)}, or build the job's own in its builder"
        )
    return classes[name]


def make_optimizer(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The `torch.optim` optimizer named `name` in lower case (`sgd`, `adam`, ...;
    `JobConfig.optimizer`) over `params`, with learning rate `lr` and its other defaults.

    Raises:
        ConfigError: torch.optim has no optimizer of that name (`custom` included: a
            job's own class is built by the job).
    """
    return optimizer_class(name)(params, lr=lr)  # type: ignore[call-arg]


def check_optimizer_step(
    optimizer: torch.optim.Optimizer | type[torch.optim.Optimizer], where: str
) -> None:
    """Refuse an optimizer whose `step()` needs an argument: a closure that evaluates the
    loss again (LBFGS calls it up to 25 times a step). A DP step hands the optimizer one
    clipped, noised gradient per step; a closure would take gradients of the raw loss,
    unclipped and without noise, which no privacy accounting covers.

    Args:
        optimizer: the job's optimizer, or the class `JobConfig.optimizer` names.
        where: how the caller names it, e.g. `JobConfig.optimizer='lbfgs'`.

    Raises:
        ConfigError: naming the optimizer, what its step() needs, and the fix.
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    try:
        params = list(inspect.signature(cls.step).parameters.values())[1:]  # self
    except (AttributeError, TypeError, ValueError):  # no step, or a builtin's: nothing to tell
        return
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    needed = [p.name for p in params if p.default is p.empty and p.kind not in variadic]
    if needed:
        raise ConfigError(
            f"{where}: {cls.__name__}.step() needs {', '.join(needed)}, a function that "
            "re-evaluates the loss, which a DP step cannot give (each step's gradient is "
            "clipped and noised once); use an optimizer whose step() needs no argument "
            "(sgd, adam, adamw, ...)"
        )
