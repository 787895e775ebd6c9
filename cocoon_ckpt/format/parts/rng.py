"""The global generators' codec: torch's (and CUDA's) states as arrays `rng/<kind>`
(`layout.rng_name`), numpy's key array too, the rest of numpy's and Python's in the
record."""

from __future__ import annotations

import numpy as np
import torch

from cocoon_ckpt.format.snapshot import Encoded, host_copy
from cocoon_ckpt.format.trainer_state import RngState
from cocoon_ckpt.layout import rng_name
from cocoon_ckpt.records import RngRecord
from state import Version

__all__ = ["decode", "encode"]


def encode(rng: RngState) -> Encoded[RngRecord]:
    """The record and arrays of the generators' states `rng`."""
    arrays = {rng_name("torch"): host_copy(rng["torch"])}
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    arrays[rng_name("numpy")] = np.asarray(np_keys)
    py_version, py_internal, py_gauss = rng["python"]
    record: RngRecord = {
        "numpy": {
            "kind": np_kind,
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": [py_version, list(py_internal), py_gauss],
    }
    for i, cuda_state in enumerate(rng.get("cuda", [])):
        arrays[rng_name(f"cuda/{i}")] = host_copy(cuda_state)
    if "cuda" in rng:
        record["cuda"] = len(rng["cuda"])
    return Encoded(record=record, arrays=arrays)


def decode(rec: RngRecord, version: Version) -> RngState:
    """The generators' states a version stores (CUDA's when it has them)."""
    npr, py = rec["numpy"], rec["python"]
    state: RngState = {
        "torch": torch.from_numpy(version.array(rng_name("torch")).copy()),
        "numpy": (
            npr["kind"],
            version.array(rng_name("numpy")).copy(),
            npr["pos"],
            npr["has_gauss"],
            npr["cached_gaussian"],
        ),
        "python": (py[0], tuple(py[1]), py[2]),
    }
    n = int(rec.get("cuda", 0))
    if n:
        state["cuda"] = [
            torch.from_numpy(version.array(rng_name(f"cuda/{i}")).copy()) for i in range(n)
        ]
    return state
