"""How the noise state maps onto a version's arrays: ring slots (new ones copied, older
ones referenced), a ring restored from any sharding, and embedding tables' online
rings, noise order and CSC (job-lifetime arrays under shared/)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from cocoon_ckpt.dp.noise import CorrelatedNoise
from cocoon_ckpt.embedding.csc import CoalescedCSC
from cocoon_ckpt.embedding.engine import TablePlan
from cocoon_ckpt.embedding.tables import EmbeddingNoise
from cocoon_ckpt.layout import emb_name, ring_name
from cocoon_ckpt.train.trainer import DPTrainer
from state import ArrayMeta, Manifest, Version

__all__ = [
    "ArraySink",
    "load_ring",
    "restore_tables",
    "ring_slots",
    "snapshot_ring",
    "snapshot_tables",
    "stored_table_plans",
]


class ArraySink(Protocol):
    """Where a snapshot collects arrays: new ones, references, job-lifetime ones."""

    arrays: dict[str, np.ndarray]
    references: dict[str, ArrayMeta]
    shared: dict[str, np.ndarray]


def ring_slots(
    noise: CorrelatedNoise,
    name_of: Callable[[int], str],
    parent: Manifest | None,
    snap: ArraySink,
) -> list[list[Any]]:
    """A ring's `[slot, step, array name]` list: slots new since the parent are copied
    into `snap.arrays`, older ones referenced from the parent in `snap.references`."""
    slots: list[list[Any]] = []
    for slot, step in enumerate(noise.slot_steps):
        if step is None:
            continue
        name = name_of(step)
        slots.append([slot, step, name])
        if parent is not None and step < parent.step and name in parent.arrays:
            snap.references[name] = parent.arrays[name]
        else:
            snap.arrays[name] = noise.history.read(slot)
    return slots


def load_ring(
    noise: CorrelatedNoise, shards: list[dict[str, Any]], version: Version
) -> dict[str, Any]:
    """The CorrelatedNoise state of `noise`'s [start, stop) from stored ring shards of
    any split: only the overlaps are read (I1 and the fixed-order kernel make the noise
    independent of how it was split)."""
    hist = noise.history
    ring = torch.zeros(hist.slots, hist.width, dtype=noise.dtype)
    slot_steps: list[int | None] = [None] * hist.slots
    for shard in shards:
        lo, hi = max(shard["start"], noise.start), min(shard["stop"], noise.stop)
        for slot, step, name in shard["slots"]:
            slot_steps[slot] = step
            if hi > lo:
                part = version.array(name)[lo - shard["start"] : hi - shard["start"]]
                ring[slot, lo - noise.start : hi - noise.start] = torch.from_numpy(part.copy())
    return {
        "kind": "CorrelatedNoise",
        "schema_version": 1,
        "t": noise.t,
        "start": noise.start,
        "stop": noise.stop,
        "dtype": str(noise.dtype).removeprefix("torch."),
        "slot_steps": slot_steps,
        "ring": ring,
    }


def snapshot_ring(trainer: DPTrainer, parent: Manifest | None, snap: ArraySink) -> dict[str, Any]:
    """This rank's ring slots, its range and where its history lay."""
    noise = trainer.noise
    rank = trainer.dist.rank if trainer.dist is not None else 0
    slots = ring_slots(noise, lambda step: ring_name(rank, step), parent, snap)
    placement = [
        {**p, "start": p["start"] + noise.start, "stop": p["stop"] + noise.start}
        for p in noise.history.placement()
    ]
    if trainer.dist is not None:
        placement = [{**p, "rank": rank} for p in placement]
    return {"start": noise.start, "stop": noise.stop, "slots": slots, "placement": placement}


def snapshot_tables(
    trainer: DPTrainer, emb: EmbeddingNoise, parent: Manifest | None, snap: ArraySink
) -> dict[str, Any]:
    """Each table's online ring (new slots only), and its CSC and noise order once."""
    tables = []
    for e in emb.engines:
        param = e.spec.param
        slots = []
        if e.online is not None:
            slots = ring_slots(
                e.online, lambda step, p=param: emb_name(p, f"ring/w-{step:08d}"), parent, snap
            )
        job_arrays = {"order": e.order}
        if e.csc is not None:
            job_arrays.update({f"csc/{k}": v for k, v in e.csc.arrays().items()})
        for k, arr in job_arrays.items():
            name = emb_name(param, k)
            if parent is not None and name in parent.arrays:
                snap.references[name] = parent.arrays[name]
            else:
                snap.shared[name] = arr
        tables.append(
            {
                "param": param,
                "rows": e.rows,
                "dim": e.dim,
                "plan": e.plan.to_record(),
                "t": e.online.t if e.online is not None else trainer.step_index,
                "online_rows": e.online_rows,
                "slots": slots,
                "csc": None
                if e.csc is None
                else {"entries": e.csc.nnz, "bytes": e.csc.nbytes, "steps": e.csc.steps},
                "precompute_seconds": e.precompute_seconds,
                "history_bytes": e.history_bytes(),
            }
        )
    return {
        "threat_model": emb.config.threat_model,
        "cursor": trainer.step_index,
        "tables": tables,
    }


def stored_table_plans(version: Version) -> dict[str, TablePlan] | None:
    """The embedding plans a version recorded (a resume must keep them)."""
    emb = version.records.get("embedding")
    if emb is None:
        return None
    return {t["param"]: TablePlan.from_record(t["plan"]) for t in emb["tables"]}


def restore_tables(trainer: DPTrainer, version: Version) -> dict[str, Any] | None:
    emb = version.records.get("embedding")
    if (emb is None) != (trainer.embedding is None):
        raise ValueError(
            f"version {version.version} {'has' if emb else 'has no'} embedding noise state, "
            f"this job {'has' if trainer.embedding else 'has no'} embedding tables"
        )
    if emb is None or trainer.embedding is None:
        return None
    states = []
    for e, rec in zip(trainer.embedding.engines, emb["tables"], strict=True):
        param = e.spec.param
        stored_order = version.array(emb_name(param, "order"))
        if not np.array_equal(stored_order, e.order):
            raise ValueError(
                f"table {param}: the stored noise order differs from the one this job's "
                "sampler and data give: the access schedule changed"
            )
        if rec["csc"] is not None:
            e.set_csc(
                CoalescedCSC.from_arrays(
                    {
                        k: version.array(emb_name(param, f"csc/{k}"))
                        for k in ("col_ptr", "rows", "values")
                    }
                )
            )
        e.precompute_seconds = float(rec.get("precompute_seconds", 0.0))
        online = None
        if e.online is not None:
            whole = [{"start": 0, "stop": e.online.stop, "slots": rec["slots"]}]
            online = {**load_ring(e.online, whole, version), "t": rec["t"]}
        states.append(
            {
                "kind": "TableEngine",
                "schema_version": 1,
                "param": param,
                "plan": rec["plan"],
                "online": online,
            }
        )
    return {
        "kind": "EmbeddingNoise",
        "schema_version": 1,
        "threat_model": emb["threat_model"],
        "tables": states,
    }
