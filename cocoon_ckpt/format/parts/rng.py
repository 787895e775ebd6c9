"""The global generators' codec: torch's (and CUDA's) states and numpy's key array,
either packed into the `rng` record (`format.packed`; what a checkpointer writes) or as
arrays `rng/<kind>` (`layout.rng_name`; versions written before the packed layout,
still read); the rest of numpy's and Python's state in the record either way."""

from __future__ import annotations

import numpy as np
import torch

from cocoon_ckpt.format.packed import MAX_CUDA_STATES, pack_array, unpack_array
from cocoon_ckpt.format.snapshot import Encoded, host_copy
from cocoon_ckpt.format.trainer_state import RngState
from cocoon_ckpt.layout import rng_name
from cocoon_ckpt.records import RngRecord
from state import Version

__all__ = ["decode", "encode", "kinds"]


def encode(rng: RngState, *, packed: bool = False) -> Encoded[RngRecord]:
    """The record of the generators' states `rng`, and their arrays unless `packed`.

    Args:
        rng: the trainer's `rng` state.
        packed: hold torch's, numpy's and CUDA's state arrays in the record (no array
            of their own); False writes them as arrays, as before the packed layout.
    """
    states = {"torch": rng["torch"].detach().cpu().numpy()}
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    states["numpy"] = np.asarray(np_keys)
    for i, cuda_state in enumerate(rng.get("cuda", [])):
        states[f"cuda/{i}"] = cuda_state.detach().cpu().numpy()
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
    if "cuda" in rng:
        record["cuda"] = len(rng["cuda"])
    if packed:
        record["packed"] = {kind: pack_array(a) for kind, a in states.items()}
        return Encoded(record=record)
    arrays = {
        rng_name(kind): a if kind == "numpy" else host_copy(torch.from_numpy(a))
        for kind, a in states.items()
    }
    return Encoded(record=record, arrays=arrays)


def kinds(rec: RngRecord) -> list[str]:
    """The generators whose states a version holds as arrays or packed: `torch`,
    `numpy`, `cuda/<i>`, from the record alone.

    Raises:
        ValueError: the record counts more CUDA generators than `MAX_CUDA_STATES`.
    """
    n = int(rec.get("cuda", 0))
    if not 0 <= n <= MAX_CUDA_STATES:
        raise ValueError(f"the rng record counts {n} CUDA generators: at most {MAX_CUDA_STATES}")
    return ["torch", "numpy", *(f"cuda/{i}" for i in range(n))]


def decode(rec: RngRecord, version: Version) -> RngState:
    """The generators' states a version stores (CUDA's when it has them), from its
    record when they are packed there, else from its arrays.

    Raises:
        ValueError: the record is packed and a state in it is missing, another than
            the generators', or malformed.
    """
    packed = rec.get("packed")
    if packed is not None:
        if not isinstance(packed, dict) or set(packed) != set(kinds(rec)):
            raise ValueError(
                f"the rng record packs {sorted(packed) if isinstance(packed, dict) else packed}"
                f", not the states of {kinds(rec)}"
            )

    def state(kind: str) -> np.ndarray:
        if packed is not None:
            try:
                return unpack_array(packed[kind])
            except ValueError as exc:
                raise ValueError(f"the rng record's {kind} state: {exc}") from None
        return version.array(rng_name(kind)).copy()

    npr, py = rec["numpy"], rec["python"]
    out: RngState = {
        "torch": torch.from_numpy(state("torch")),
        "numpy": (
            npr["kind"],
            state("numpy"),
            npr["pos"],
            npr["has_gauss"],
            npr["cached_gaussian"],
        ),
        "python": (py[0], tuple(py[1]), py[2]),
    }
    n = len(kinds(rec)) - 2
    if n:
        out["cuda"] = [torch.from_numpy(state(f"cuda/{i}")) for i in range(n)]
    return out
