"""The snapshot codec: the trainer's state dict <-> a version's arrays and records.

`encode` turns exactly what `DPTrainer.state_dict()` returns into host copies of the
arrays (the ring slots new since the parent version as one array of rows, older ones
referenced from it: `format.ring_rows`) and the typed records of `cocoon_ckpt.records`;
`decode` turns a verified version back into the dict `DPTrainer.load_state_dict()`
takes. Embedding tables are `format.table_codec`'s part. The store format is
docs/store-format.md.

The trainer is never imported here. A version's single parts (the model, the config,
the embedding plans) are read by `cocoon_ckpt.format.stored`, which the tools use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from cocoon_ckpt.format.part_state import decode_part_state, encode_part_state
from cocoon_ckpt.format.ring_rows import borrowable, encode_slots, load_ring
from cocoon_ckpt.format.stored import model_state, records_of
from cocoon_ckpt.format.table_codec import decode_tables, encode_tables
from cocoon_ckpt.format.trainer_state import TRAINER_SCHEMA, PartState, RngState, TrainerState
from cocoon_ckpt.layout import model_name, optim_name, ring_rows_name, rng_name
from cocoon_ckpt.records import (
    AccountantRecord,
    BLTRecord,
    GeneratorRecord,
    MechanismRecord,
    NoiseRecord,
    OptimizerRecord,
    OptimizerValue,
    PartStateRecord,
    RankShard,
    RngRecord,
    SamplerRecord,
    ShardRecord,
    SnapshotRecords,
)
from state import ArrayMeta, Manifest, Version

__all__ = [
    "Snapshot",
    "decode",
    "encode",
]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().copy()


@dataclass(kw_only=True, slots=True)
class Snapshot:
    """A host-memory copy of one checkpoint, ready to be written."""

    step: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    references: dict[str, ArrayMeta] = field(default_factory=dict)
    shared: dict[str, np.ndarray] = field(default_factory=dict)
    """Job-lifetime arrays new in this version (the precomputed CSC): written once
    under shared/, referenced by every later version. Not copied: they never change."""
    shard: RankShard | None = None
    """This rank's ring shard (a multi-process job's coordinator gathers every rank's)."""
    records: dict[str, Any] = field(default_factory=dict)
    """Every record to write (`SnapshotRecords` plus the runner's; empty on a rank
    other than the coordinator)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


# -- encode -------------------------------------------------------------------------


def _parent_shard(parent: Manifest | None, start: int, stop: int) -> Any:
    """The parent's slot entries for the ring shard of columns [start, stop) (None:
    no parent, or none of these columns: every slot is new)."""
    if parent is None:
        return None
    for shard in records_of(parent)["noise"]["shards"]:
        if (shard["start"], shard["stop"]) == (start, stop):
            return shard["slots"]
    return None


def _optimizer(opt: dict[str, Any], snap: Snapshot) -> OptimizerRecord:
    """torch's optimizer state: tensors to arrays `optim/<idx>/<key>`, the rest kept."""
    state: dict[str, dict[str, OptimizerValue]] = {}
    for idx, st in opt["state"].items():
        rec: dict[str, OptimizerValue] = {}
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                snap.arrays[optim_name(idx, key)] = _to_numpy(val)
                rec[key] = {"array": optim_name(idx, key)}
            else:
                rec[key] = {"value": val}
        state[str(idx)] = rec
    return {"param_groups": opt["param_groups"], "state": state}


def encode(state: TrainerState, parent: Manifest | None, *, shard_only: bool = False) -> Snapshot:
    """Host copies of `state`'s arrays and its records, ring slots the parent version
    already holds referenced.

    Args:
        state: `DPTrainer.state_dict()`.
        parent: the version this one follows (None: the first).
        shard_only: encode only this rank's ring shard (the ranks of a multi-process job
            other than the coordinator: every other part is the same on every rank).
    """
    snap = Snapshot(step=state["step"])
    noise, layout = state["noise"], state["noise_layout"]
    rank = layout["rank"] or 0
    # rows every step rewrites (a BLT's buffers): nothing of the parent's can be borrowed
    persistent = noise["persistent_rows"]
    slots = encode_slots(
        noise["ring"],
        noise["slot_steps"],
        lambda first, last: ring_rows_name(rank, first, last),
        parent,
        {}
        if not persistent
        else borrowable(parent, _parent_shard(parent, noise["start"], noise["stop"])),
        snap.arrays,
        snap.references,
    )
    shard: ShardRecord = {"start": noise["start"], "stop": noise["stop"], "slots": slots}
    snap.shard = {**shard, "placement": layout["placement"]}
    if shard_only:
        return snap
    for name, t in state["model"].items():
        snap.arrays[model_name(name)] = _to_numpy(t)
    rng = state["rng"]
    snap.arrays[rng_name("torch")] = _to_numpy(rng["torch"])
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = rng["numpy"]
    snap.arrays[rng_name("numpy")] = np.asarray(np_keys)
    py_version, py_internal, py_gauss = rng["python"]
    rng_record: RngRecord = {
        "numpy": {
            "kind": np_kind,
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": [py_version, list(py_internal), py_gauss],
    }
    for i, cuda_state in enumerate(rng.get("cuda", [])):
        snap.arrays[rng_name(f"cuda/{i}")] = _to_numpy(cuda_state)
    if "cuda" in rng:
        rng_record["cuda"] = len(rng["cuda"])
    ring_slots = len(noise["slot_steps"])
    noise_record: NoiseRecord = {
        "t": noise["t"],
        "dim": layout["dim"],
        "dtype": noise["dtype"],
        # rows every step rewrites (BLT buffers) have no head
        "head": noise["t"] % ring_slots if ring_slots and persistent else 0,
        # storage: whole-width slots per rank shard, whatever the placement, so a
        # resume on other tiers or another world size re-plans and loads the same arrays
        "shards": [shard],
        "placement": list(layout["placement"]),
        "plan": layout["plan"],
        "history_bytes": layout["history_bytes"],
    }
    records: SnapshotRecords = {
        "trainer": {"step": state["step"]},
        "optimizer": _optimizer(state["optimizer"], snap),
        "sampler": cast(SamplerRecord, state["sampler"]),
        "accountant": cast(AccountantRecord, state["accountant"]),
        "mechanism": cast(MechanismRecord | BLTRecord, state["mechanism"]),
        "noise": noise_record,
        "generator": cast(GeneratorRecord, state["generator"]),
        "rng": rng_record,
        "param_names": list(layout["param_names"]),
    }
    if state["embedding"] is not None:
        records["embedding"] = encode_tables(state, parent, snap)
    if state["identity"] is not None:
        records["identity"] = state["identity"]
    _parts(state, records, snap)
    snap.records = dict(records)
    return snap


def _part(part: PartState, prefix: str, snap: Snapshot) -> PartStateRecord:
    try:
        return {
            "kind": part["kind"],
            "state": encode_part_state(part["state"], prefix, snap.arrays),
        }
    except TypeError as exc:
        raise TypeError(f"{part['kind']}.state_dict(): {exc}") from None


def _parts(state: TrainerState, records: SnapshotRecords, snap: Snapshot) -> None:
    """The scheduler's and stateful parts' records, their tensors as arrays (written
    only where the job has them: other versions are as before)."""
    if state["scheduler"] is not None:
        records["scheduler"] = _part(state["scheduler"], "scheduler", snap)
    if state["stateful"]:
        records["stateful"] = {
            name: _part(part, f"stateful/{name}", snap) for name, part in state["stateful"].items()
        }


# -- decode -------------------------------------------------------------------------


def _decode_optimizer(rec: OptimizerRecord, version: Version) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for idx, st in rec["state"].items():
        state[int(idx)] = {
            key: torch.from_numpy(version.array(v["array"]).copy()) if "array" in v else v["value"]
            for key, v in st.items()
        }
    return {"param_groups": rec["param_groups"], "state": state}


def decode(version: Version, like: TrainerState) -> TrainerState:
    """The trainer state a verified version holds, for `DPTrainer.load_state_dict()`.

    Args:
        version: the version to resume from.
        like: the receiving trainer's own `state_dict()`: its ring shard's range, shape
            and dtype (any stored sharding is read onto it) and its layout.

    Raises:
        ValueError: the version and the trainer disagree on embedding tables.
        KeyError, TypeError, IndexError: a record is malformed.
    """
    rec = records_of(version)
    nrec = rec["noise"]
    embedding, tables = decode_tables(version, like)
    return {
        "kind": "DPTrainer",
        "schema_version": TRAINER_SCHEMA,
        "step": rec["trainer"]["step"],
        "model": model_state(version),
        "optimizer": _decode_optimizer(rec["optimizer"], version),
        "noise": {**load_ring(like["noise"], nrec["shards"], version), "t": nrec["t"]},
        # where the history lies now is this job's choice: the noise does not depend on it
        "noise_layout": like["noise_layout"],
        "sampler": dict(rec["sampler"]),
        "accountant": dict(rec["accountant"]),
        "mechanism": dict(rec["mechanism"]),
        "generator": dict(rec["generator"]),
        "rng": _decode_rng(version, rec["rng"]),
        "embedding": embedding,
        "embedding_tables": tables,
        "identity": rec.get("identity"),
        "scheduler": _decode_part(rec.get("scheduler"), version),
        "stateful": {
            name: part
            for name, r in rec.get("stateful", {}).items()
            if (part := _decode_part(r, version)) is not None
        },
    }


def _decode_part(rec: PartStateRecord | None, version: Version) -> PartState | None:
    if rec is None:
        return None
    try:
        state = decode_part_state(rec["state"], version.array)
    except ValueError as exc:
        raise TypeError(f"{rec['kind']} state: {exc}") from None
    return {"kind": rec["kind"], "state": state}


def _decode_rng(version: Version, rec: RngRecord) -> RngState:
    """The global generators' states a version stores (CUDA's when it has them)."""
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
