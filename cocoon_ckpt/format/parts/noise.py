"""The dense correlated noise's codec: this rank's ring shard as rows (`format.ring_rows`:
only the slots new since the parent version are copied, older ones referenced) and the
`noise` record (step, head, shards, where the history lay)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cocoon_ckpt.format.ring_rows import borrowable, encode_slots, load_ring
from cocoon_ckpt.format.snapshot import BUFFERS, Encoded, defer_row_checksum, lend_row
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.format.trainer_state import NoiseLayout
from cocoon_ckpt.layout import ring_rows_name
from cocoon_ckpt.records import NoiseRecord, ShardRecord
from state import ArrayMeta, Manifest, Version

__all__ = ["decode", "encode"]


def _parent_shard(parent: Manifest | None, start: int, stop: int) -> Any:
    """The parent's slot entries for the ring shard of columns [start, stop) (None:
    no parent, or none of these columns: every slot is new)."""
    if parent is None:
        return None
    for shard in records_of(parent)["noise"]["shards"]:
        if (shard["start"], shard["stop"]) == (start, stop):
            return shard["slots"]
    return None


def encode(
    noise: dict[str, Any], layout: NoiseLayout, parent: Manifest | None
) -> Encoded[NoiseRecord]:
    """The record of this rank's noise state and the ring rows new since `parent`.

    Args:
        noise: the `NoiseMechanism.state_dict()` of this rank's shard (its `ring` the
            live rows, `persistent_rows` whether a row outlives the step that wrote it).
        layout: where the history lies and what the vector is (`noise_layout`).
        parent: the version this one follows (None: the first).
    """
    rank = layout["rank"] or 0
    # rows every step rewrites (a BLT's buffers): nothing of the parent's can be borrowed
    persistent = noise["persistent_rows"]
    arrays: dict[str, np.ndarray] = {}
    references: dict[str, ArrayMeta] = {}
    slots = encode_slots(
        noise["ring"],
        noise["slot_steps"],
        lambda first, last: ring_rows_name(rank, first, last),
        parent,
        borrowable(parent, _parent_shard(parent, noise["start"], noise["stop"]))
        if persistent
        else {},
        arrays,
        references,
        take=BUFFERS.take,
        lend=lend_row if persistent else None,  # a BLT rewrites its rows each step
        defer=defer_row_checksum,  # a lent row's checksum: its writer's
    )
    shard: ShardRecord = {"start": noise["start"], "stop": noise["stop"], "slots": slots}
    ring_slots = len(noise["slot_steps"])
    record: NoiseRecord = {
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
    return Encoded(record=record, arrays=arrays, references=references)


def decode(rec: NoiseRecord, version: Version, like: dict[str, Any]) -> dict[str, Any]:
    """The noise state a version holds, read onto the receiving noise's shard `like`
    (its range, shape and dtype: any stored sharding is read onto it)."""
    return {**load_ring(like, rec["shards"], version), "t": rec["t"]}
