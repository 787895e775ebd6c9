"""What a job really runs, read from its objects: the optimizer's class and every
param_group hyperparameter, the scheduler's class and initial state, the dataset's size
and a digest of a seeded sample of its examples, and the device type the model runs on.

The device type is recorded only when it is not the CPU (`device`: {"type": "cuda"});
a record without it means the CPU, so the stores written before it keep their
fingerprints and resume on the CPU. Per-sample gradients on another device type differ
in the last bits, so a resume on another is refused like any other difference, unless
the caller allows a device change (`identity_differences(allow_device_change=True)`);
the noise itself is the same on every device type (`train.device`).

Taken when the trainer is built (before a resume loads anything), recorded in every
version (`identity`) and compared on resume: a difference is refused, listed item by
item. The config's `lr`/`optimizer` describe the job too; `check_config_optimizer`
refuses a job whose optimizer contradicts them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from cocoon_ckpt.errors import ConfigError
from cocoon_ckpt.records import IdentityRecord

__all__ = [
    "DEVICE_DEFAULT",
    "DIGEST_EXAMPLES",
    "check_config_optimizer",
    "dataset_digest",
    "identity_differences",
    "job_identity",
    "optimizer_description",
]

#: Examples hashed for the dataset's content digest (a seeded sample: cheap for any N).
DIGEST_EXAMPLES = 16
#: The device type a record without `device` ran on (stores written before it).
DEVICE_DEFAULT = "cpu"


def _qualname(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON (tuples as lists, 0-d tensors as numbers, other objects by
    their type: a callable in a LambdaLR is named, not serialised)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, torch.Tensor | np.ndarray | np.generic):
        arr = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value)
        return arr.tolist() if arr.size <= 64 else f"<{arr.dtype} {list(arr.shape)}>"
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return f"<{_qualname(value)}>"


@contextlib.contextmanager
def _fixed_generators() -> Iterator[None]:
    """Global generators seeded for reading the sample (a Dataset's random transforms
    give the same items each time), restored after."""
    states = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        torch.default_generator.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


def _hash_item(h: Any, item: Any) -> None:
    parts = item if isinstance(item, list | tuple) else (item,)
    for part in parts:
        if isinstance(part, torch.Tensor | np.ndarray):
            arr = np.ascontiguousarray(
                part.detach().cpu().numpy() if isinstance(part, torch.Tensor) else part
            )
            h.update(f"{arr.dtype}{list(arr.shape)}".encode())
            h.update(arr.tobytes())
        else:
            h.update(repr(part).encode())


def dataset_digest(dataset: Dataset[Any], size: int, seed: int) -> str:
    """sha256 over `DIGEST_EXAMPLES` examples drawn by `seed` (every example when fewer):
    their dtypes, shapes and bytes."""
    picks = np.random.default_rng(seed).choice(size, min(size, DIGEST_EXAMPLES), replace=False)
    h = hashlib.sha256()
    with _fixed_generators():
        for i in sorted(int(j) for j in picks):
            h.update(str(i).encode())
            if isinstance(dataset, TensorDataset):
                _hash_item(h, tuple(t[i] for t in dataset.tensors))
            else:
                _hash_item(h, dataset[i])
    return h.hexdigest()


def job_identity(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    dataset: Dataset[Any],
    size: int,
    seed: int,
    device: torch.device | None = None,
) -> IdentityRecord:
    """The identity of a job's real objects, as built (before any step or resume).

    Args:
        optimizer, scheduler: the job's optimizer and LR scheduler (None: none).
        dataset, size, seed: the training set, its size and the job's seed (the digest's
            sample).
        device: the model's device (`train.device.model_device`; None: the CPU); its type
            is recorded when it is not the CPU.
    """
    groups = [
        {**{k: _jsonable(v) for k, v in g.items() if k != "params"}, "params": len(g["params"])}
        for g in optimizer.param_groups
    ]
    record: dict[str, Any] = {
        "optimizer": {"class": _qualname(optimizer), "param_groups": groups},
        "scheduler": None
        if scheduler is None
        else {"class": _qualname(scheduler), "state": _jsonable(scheduler.state_dict())},
        "dataset": {"size": size, "digest": dataset_digest(dataset, size, seed)},
    }
    kind = DEVICE_DEFAULT if device is None else torch.device(device).type
    if kind != DEVICE_DEFAULT:
        record["device"] = {"type": kind}
    return cast(IdentityRecord, record)  # built as a dict: the JSON forms are checked above


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, dict):
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, v in enumerate(value):
            _flat(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value
    return out


def identity_differences(
    stored: IdentityRecord, now: IdentityRecord, *, allow_device_change: bool = False
) -> list[str]:
    """One line per difference, e.g. `optimizer.param_groups[0].momentum: stored 0.9,
    now 0.0` or `device.type: stored 'cpu', now 'cuda'` (a record without `device`
    ran on the CPU).

    Args:
        stored, now: the version's identity and this job's.
        allow_device_change: leave the device type out (a resume on another device type
            the caller accepts: the noise is the same, parameters differ in the last bits).
    """
    a, b = _flat(dict(stored), "", {}), _flat(dict(now), "", {})
    for flat in (a, b):
        flat.setdefault("device.type", DEVICE_DEFAULT)
    if allow_device_change:
        del a["device.type"], b["device.type"]
    return [
        f"{k}: stored {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]


def optimizer_description(optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[str, float]:
    """What `JobConfig.optimizer` and `lr` say of a built optimizer: torch.optim's class
    name in lower case (`custom` for a class of the job's own, recorded in the identity)
    and the first group's learning rate as built (before any scheduler step)."""
    real = type(optimizer).__name__.lower()
    if type(optimizer) is not getattr(torch.optim, type(optimizer).__name__, None):
        real = "custom"  # a class of the job's own: recorded in the identity
    group = optimizer.param_groups[0]
    # a scheduler moves lr at once (LinearLR's warm-up); initial_lr is what was built
    real_lr = group.get("initial_lr", group["lr"]) if scheduler is not None else group["lr"]
    return real, float(real_lr)


def check_config_optimizer(
    optimizer: torch.optim.Optimizer, name: str, lr: float, scheduler: Any
) -> None:
    """Refuse an optimizer that `JobConfig.optimizer`/`lr` do not describe (the config
    record would say another optimizer ran).

    Raises:
        ConfigError: the class or the first group's learning rate (before any scheduler
            step) differs, naming both and the fix.
    """
    real, real_lr = optimizer_description(optimizer, scheduler)
    if real != name or real_lr != lr:
        raise ConfigError(
            f"the job's optimizer is {type(optimizer).__name__} with lr={real_lr:g}, but "
            f"JobConfig says optimizer={name!r}, lr={lr:g}: the recorded config must say "
            f"what runs. Pass --optimizer {real} --lr {real_lr!r} (JobConfig(optimizer="
            f"{real!r}, lr={real_lr!r})), or build the optimizer from config.optimizer and "
            "config.lr (train.parts.make_optimizer)"
        )
