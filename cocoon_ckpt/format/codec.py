"""The snapshot codec: the trainer's state dict <-> a version's arrays and records.

`encode` turns exactly what `DPTrainer.state_dict()` returns into a `Snapshot` (host
copies of the arrays and the typed records of `cocoon_ckpt.records`); `decode` turns a
verified version back into the dict `DPTrainer.load_state_dict()` takes. Each part has
its own codec, which returns its record and arrays (`format.parts`: model, optimizer,
rng, noise, the job's own parts, the embedding tables); this
module only puts them together. The store format is docs/store-format.md.

The trainer is never imported here. A version's single parts (the model, the newest
records, the embedding plans) are read by `cocoon_ckpt.format.stored`, which the tools
use.
"""

from __future__ import annotations

from typing import cast

from cocoon_ckpt.format.parts import model, noise, optimizer, rng, tables, user
from cocoon_ckpt.format.snapshot import Snapshot
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.format.trainer_state import TRAINER_SCHEMA, TrainerState
from cocoon_ckpt.layout import SCHEDULER_PREFIX, stateful_prefix
from cocoon_ckpt.records import (
    AccountantRecord,
    BLTRecord,
    GeneratorRecord,
    MechanismRecord,
    SamplerRecord,
    SnapshotRecords,
)
from state import Manifest, Version

__all__ = ["Snapshot", "decode", "encode"]


def encode(
    state: TrainerState,
    parent: Manifest | None,
    *,
    shard_only: bool = False,
    packed: bool = False,
) -> Snapshot:
    """Host copies of `state`'s arrays and its records, ring slots the parent version
    already holds referenced.

    Args:
        state: `DPTrainer.state_dict()`.
        parent: the version this one follows (None: the first).
        shard_only: encode only this rank's ring shard (the ranks of a multi-process job
            other than the coordinator: every other part is the same on every rank).
        packed: the packed layout, which a checkpointer writes: the opaque small state
            (the generators') held in its record, not as arrays of their own (five
            files fewer a version). False: the layout of versions written before it
            (tests/cocoon_ckpt/golden/format_store). `decode` reads both.

    Raises:
        TypeError: a scheduler's or stateful part's state the format cannot hold.
    """
    snap = Snapshot(step=state["step"])
    layout = state["noise_layout"]
    noise_record = snap.take(noise.encode(state["noise"], layout, parent))
    snap.shard = {**noise_record["shards"][0], "placement": layout["placement"]}
    if shard_only:
        if state["embedding"] is not None:  # the rank's part of each CSC held by parts
            snap.take(tables.encode_part(state, parent))
        return snap
    snap.take(model.encode(state["model"]))
    rng_record = snap.take(rng.encode(state["rng"], packed=packed))
    records: SnapshotRecords = {
        "trainer": {"step": state["step"]},
        "optimizer": snap.take(optimizer.encode(state["optimizer"])),
        "sampler": cast(SamplerRecord, state["sampler"]),
        "accountant": cast(AccountantRecord, state["accountant"]),
        "mechanism": cast(MechanismRecord | BLTRecord, state["mechanism"]),
        "noise": noise_record,
        "generator": cast(GeneratorRecord, state["generator"]),
        "rng": rng_record,
        "param_names": list(layout["param_names"]),
    }
    # parts written only where the job has them: other versions are as before
    if state["embedding"] is not None:
        records["embedding"] = snap.take(tables.encode(state, parent))
    if state["identity"] is not None:
        records["identity"] = state["identity"]
    if state["scheduler"] is not None:
        records["scheduler"] = snap.take(user.encode(state["scheduler"], SCHEDULER_PREFIX))
    if state["stateful"]:
        records["stateful"] = {
            name: snap.take(user.encode(part, stateful_prefix(name)))
            for name, part in state["stateful"].items()
        }
    snap.records = dict(records)
    return snap


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
    embedding, table_arrays = tables.decode(version, like)
    return {
        "kind": "DPTrainer",
        "schema_version": TRAINER_SCHEMA,
        "step": rec["trainer"]["step"],
        "model": model.decode(version),
        "optimizer": optimizer.decode(rec["optimizer"], version),
        "noise": noise.decode(rec["noise"], version, like["noise"]),
        # where the history lies now is this job's choice: the noise does not depend on it
        "noise_layout": like["noise_layout"],
        "sampler": dict(rec["sampler"]),
        "accountant": dict(rec["accountant"]),
        "mechanism": dict(rec["mechanism"]),
        "generator": dict(rec["generator"]),
        "rng": rng.decode(rec["rng"], version),
        "embedding": embedding,
        "embedding_tables": table_arrays,
        "identity": rec.get("identity"),
        "scheduler": user.decode(rec.get("scheduler"), version),
        "stateful": {
            name: part
            for name, r in rec.get("stateful", {}).items()
            if (part := user.decode(r, version)) is not None
        },
    }
