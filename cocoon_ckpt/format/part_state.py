"""Any part's state dict (an LR scheduler's, a user's EMA or counter) <-> a version's
arrays and one JSON record: tensors and numpy arrays become arrays `<prefix>/<i>`, the
rest stays in the record, tagged so it reads back exactly (a tuple stays a tuple, a dict
keeps its non-string keys, a tensor its dtype).

Record grammar: a str, int, finite float, bool or None is itself; `{"tensor": name}`,
`{"ndarray": name}`, `{"list": [...]}`, `{"tuple": [...]}`,
`{"dict": [[key, value], ...]}` (keys are plain JSON scalars) and `{"float": "nan"}`
(`"inf"`, `"-inf"`: JSON has no such numbers, and a manifest stays JSON) are the rest.
A state nests at most `MAX_PART_DEPTH` levels (the record takes up to 3 JSON levels for
each, within `state.canonical_json.MAX_DEPTH`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["MAX_PART_DEPTH", "decode_part_state", "encode_part_state"]

#: The deepest nesting of lists, tuples and dicts a part's state may have.
MAX_PART_DEPTH = 32
_SCALARS = (str, int, float, bool, type(None))
_NON_FINITE = ("nan", "inf", "-inf")


def encode_part_state(state: Any, prefix: str, arrays: dict[str, np.ndarray] | None) -> Any:
    """The record of `state`; its tensors (host copies) and arrays go into `arrays`.

    Args:
        state: what a part's `state_dict()` returned.
        prefix: array name prefix (`scheduler`, `stateful/<name>`).
        arrays: receives the arrays, named `<prefix>/<i>`; None checks `state` only (no
            copies), as a start does before anything is written.

    Raises:
        TypeError: `state` holds something else than tensors, arrays, numbers, strings,
            None, lists, tuples and dicts with scalar keys, or nests deeper than
            `MAX_PART_DEPTH` (named by its path).
    """
    count = [0]

    def array_name() -> str:
        name = f"{prefix}/{count[0]}"
        count[0] += 1
        return name

    def enc(value: Any, path: str, depth: int) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return {"float": repr(float(value))}
        if isinstance(value, _SCALARS):
            return value
        if isinstance(value, torch.Tensor):
            name = array_name()
            if arrays is not None:
                arrays[name] = value.detach().cpu().contiguous().numpy().copy()
            return {"tensor": name}
        if isinstance(value, np.ndarray):
            name = array_name()
            if arrays is not None:
                arrays[name] = np.array(value, copy=True, order="C")
            return {"ndarray": name}
        if isinstance(value, np.generic):
            return enc(value.item(), path, depth)
        if isinstance(value, list | tuple | dict) and depth >= MAX_PART_DEPTH:
            raise TypeError(
                f"{path} nests deeper than {MAX_PART_DEPTH} levels of lists, tuples and "
                "dicts; flatten the state, or hold its deep parts in a tensor"
            )
        if isinstance(value, list | tuple):
            items = [enc(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
            return {"tuple" if isinstance(value, tuple) else "list": items}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, _SCALARS)]
            if bad:
                raise TypeError(f"{path} has a key {bad[0]!r} of type {type(bad[0]).__name__}")
            return {"dict": [[k, enc(v, f"{path}[{k!r}]", depth + 1)] for k, v in value.items()]}
        raise TypeError(
            f"{path} is a {type(value).__name__}: a checkpointed state_dict() may hold "
            "tensors, numpy arrays, numbers, strings, None, lists, tuples and dicts; "
            "return its state in those"
        )

    return enc(state, prefix, 0)


def decode_part_state(record: Any, array: Callable[[str], np.ndarray]) -> Any:
    """The state `encode_part_state` recorded; `array(name)` reads a version's array.

    Raises:
        ValueError: the record is not of the grammar above.
    """
    if isinstance(record, _SCALARS):
        return record
    if not isinstance(record, dict) or len(record) != 1:
        raise ValueError(f"part state record {record!r} is not a tagged value")
    ((tag, body),) = record.items()
    if tag == "tensor":
        return torch.from_numpy(array(body).copy())
    if tag == "ndarray":
        return array(body).copy()
    if tag == "list":
        return [decode_part_state(v, array) for v in body]
    if tag == "tuple":
        return tuple(decode_part_state(v, array) for v in body)
    if tag == "dict":
        return {k: decode_part_state(v, array) for k, v in body}
    if tag == "float" and body in _NON_FINITE:
        return float(body)
    raise ValueError(f"part state record has an unknown tag {tag!r}")
