"""The codec of the job's own parts: the learning-rate scheduler and the `stateful`
parts a job builder returns. Each state dict in the `part_state` grammar (tagged JSON),
its tensors as arrays under `layout.SCHEDULER_PREFIX` or `layout.stateful_prefix`."""

from __future__ import annotations

import numpy as np

from cocoon_ckpt.format.part_state import decode_part_state, encode_part_state
from cocoon_ckpt.format.snapshot import Encoded
from cocoon_ckpt.format.trainer_state import PartState
from cocoon_ckpt.records import PartStateRecord
from state import Version

__all__ = ["array_names", "decode", "encode"]

#: What `array_names` hands the grammar's reader for each array: nothing is read.
_UNREAD = np.zeros(0)


def encode(part: PartState, prefix: str) -> Encoded[PartStateRecord]:
    """The record of one part's state and its tensors' copies, named `<prefix>/<i>`.

    Raises:
        TypeError: the part's state holds something the grammar cannot hold (named by
            the part's kind and the value's path).
    """
    arrays: dict[str, np.ndarray] = {}
    try:
        state = encode_part_state(part["state"], prefix, arrays)
    except TypeError as exc:
        raise TypeError(f"{part['kind']}.state_dict(): {exc}") from None
    return Encoded(record={"kind": part["kind"], "state": state}, arrays=arrays)


def decode(rec: PartStateRecord | None, version: Version) -> PartState | None:
    """The part's state `rec` records (None: the version holds no such part).

    Raises:
        TypeError: the record is not in the grammar (named by the part's kind).
    """
    if rec is None:
        return None
    try:
        state = decode_part_state(rec["state"], version.array)
    except ValueError as exc:
        raise TypeError(f"{rec['kind']} state: {exc}") from None
    return {"kind": rec["kind"], "state": state}


def array_names(rec: PartStateRecord, prefix: str) -> list[str]:
    """The arrays a part's record names, from the record alone (no array is read), as a
    reader checks them before reading: every one inside the part's folder `prefix/`.

    Raises:
        ValueError: the record is not in the grammar, or names an array outside
            `prefix/` (named by the part's kind).
    """
    names: list[str] = []

    def note(name: str) -> np.ndarray:
        names.append(name)
        return _UNREAD

    decode_part_state(rec["state"], note)
    outside = [n for n in names if not (isinstance(n, str) and n.startswith(f"{prefix}/"))]
    if outside:
        raise ValueError(f"{rec['kind']} state names array {outside[0]} outside {prefix}/")
    return names
