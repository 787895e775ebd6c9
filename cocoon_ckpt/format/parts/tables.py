"""The embedding tables' codec: each table's online ring (new slots as rows), its CSC
and noise order (job-lifetime arrays under shared/, referenced once written) <-> the
`embedding` record and the trainer state's table entries."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from cocoon_ckpt.embedding.csc_shards import CscPart, StoredParts, part_name, part_nbytes
from cocoon_ckpt.embedding.csc_window import CSC_PARTS, CscWindows, StoredCSC
from cocoon_ckpt.errors import StoredStateError
from cocoon_ckpt.format.ring_rows import borrowable, encode_slots, load_ring
from cocoon_ckpt.format.snapshot import Encoded
from cocoon_ckpt.format.stored import records_of
from cocoon_ckpt.format.trainer_state import TableArrays, TrainerState
from cocoon_ckpt.layout import emb_name, table_ring_rows_name
from cocoon_ckpt.records import CscRecord, EmbeddingRecord, RingSlot, ShardRecord, TableRecord
from state import ArrayMeta, Manifest, Version

__all__ = ["decode", "encode", "encode_part"]


def _parent_slots(parent: Manifest | None, param: str) -> Any:
    """Table `param`'s online ring entries in the parent version (None: none)."""
    if parent is None:
        return None
    emb = records_of(parent).get("embedding")
    for t in emb["tables"] if emb else []:
        if t["param"] == param:
            return t["slots"]
    return None


def encode(state: TrainerState, parent: Manifest | None) -> Encoded[EmbeddingRecord]:
    """Each table's online ring (new slots only), and its CSC and noise order once (as
    shared arrays: the first version that holds them writes them, later ones refer)."""
    emb = state["embedding"]
    extra = state["embedding_tables"]
    if emb is None or extra is None:
        raise ValueError("the trainer state has embedding noise state but no table arrays")
    tables: list[TableRecord] = []
    arrays: dict[str, np.ndarray] = {}
    references: dict[str, ArrayMeta] = {}
    shared: dict[str, np.ndarray] = {}
    for st, arrs in zip(emb["tables"], extra, strict=True):
        param = st["param"]
        online = st["online"]
        slots: list[RingSlot] = []
        if online is not None:
            slots = encode_slots(
                online["ring"],
                online["slot_steps"],
                functools.partial(table_ring_rows_name, param),
                parent,
                borrowable(parent, _parent_slots(parent, param)),
                arrays,
                references,
            )
        csc = arrs["csc"]
        job_arrays = {emb_name(param, "order"): arrs["order"]}
        csc_record: CscRecord | None = None
        if isinstance(csc, CscPart):  # several ranks: this rank's part, the others' listed
            job_arrays.update(_part_arrays(param, csc))
            csc_record = _parts_record(csc, arrs["dim"])
        elif isinstance(csc, StoredParts):  # committed in parts, not read (yet)
            references.update(
                {part_name(param, a, z, k): m for a, z, ms in csc.parts for k, m in ms.items()}
            )
            csc_record = {
                "entries": csc.nnz,
                "bytes": csc.nbytes,
                "steps": csc.steps,
                "parts": [
                    {"start": a, "stop": z, "entries": int(ms["rows"].shape[0])}
                    for a, z, ms in csc.parts
                ],
            }
        elif isinstance(csc, CscWindows | StoredCSC):  # read in windows: it is committed
            references.update({emb_name(param, f"csc/{k}"): m for k, m in csc.metas.items()})
        elif csc is not None:
            job_arrays.update({emb_name(param, f"csc/{k}"): v for k, v in csc.arrays().items()})
        if csc is not None and csc_record is None:
            csc_record = {"entries": csc.nnz, "bytes": csc.nbytes, "steps": csc.steps}
        for name, arr in job_arrays.items():
            if parent is not None and name in parent.arrays:
                references[name] = parent.arrays[name]
            else:
                shared[name] = arr
        tables.append(
            {
                "param": param,
                "rows": arrs["rows"],
                "dim": arrs["dim"],
                "plan": st["plan"],
                "t": online["t"] if online is not None else state["step"],
                "online_rows": arrs["online_rows"],
                "slots": slots,
                "csc": csc_record,
                "precompute_seconds": arrs["precompute_seconds"],
                "history_bytes": arrs["history_bytes"],
            }
        )
    record: EmbeddingRecord = {
        "threat_model": emb["threat_model"],
        "cursor": state["step"],
        "tables": tables,
    }
    return Encoded(record=record, arrays=arrays, references=references, shared=shared)


def _part_arrays(param: str, part: CscPart) -> dict[str, np.ndarray]:
    """A rank's CSC part by its stored names (`embedding.csc_shards.part_name`)."""
    if part.stop == part.start:  # a rank with no tile of this table holds nothing
        return {}
    return {part_name(param, part.start, part.stop, k): getattr(part, k) for k in CSC_PARTS}


def _parts_record(part: CscPart, dim: int) -> CscRecord:
    """The `csc` record of a table held in parts: every rank's slot range and entries
    (known from the schedule, so the coordinator lists the parts it does not hold)."""
    itemsize = part.values.dtype.itemsize
    return {
        "entries": part.whole_nnz,
        "bytes": sum(part_nbytes(part.steps, e, dim, itemsize) for e in part.entries),
        "steps": part.steps,
        "parts": [
            {"start": a, "stop": z, "entries": e}
            for (a, z), e in zip(part.bounds, part.entries, strict=True)
            if z > a
        ],
    }


def encode_part(state: TrainerState, parent: Manifest | None) -> Encoded[None]:
    """What a rank other than the coordinator writes of the tables: its part of each
    CSC held by parts, as arrays of its own version folder where the parent does not
    hold it already (the coordinator's record lists every part; the rest of the tables'
    state is the same on every rank and the coordinator's to write)."""
    extra = state["embedding_tables"]
    arrays: dict[str, np.ndarray] = {}
    references: dict[str, ArrayMeta] = {}
    for arrs in extra or []:
        csc = arrs["csc"]
        if not isinstance(csc, CscPart):
            continue
        for name, arr in _part_arrays(arrs["param"], csc).items():
            if parent is not None and name in parent.arrays:
                references[name] = parent.arrays[name]
            else:
                arrays[name] = arr
    return Encoded(record=None, arrays=arrays, references=references)


def decode(
    version: Version, like: TrainerState
) -> tuple[dict[str, Any] | None, list[TableArrays] | None]:
    """The embedding state and table arrays a version holds (None, None: no tables).

    Raises:
        StoredStateError: the version and the trainer disagree on embedding tables.
    """
    emb = records_of(version).get("embedding")
    if (emb is None) != (like["embedding"] is None):
        raise StoredStateError(
            f"version {version.version} {'has' if emb else 'has no'} embedding noise state, "
            f"this job {'has' if like['embedding'] else 'has no'} embedding tables"
        )
    if emb is None or like["embedding"] is None:
        return None, None
    states, arrays = [], []
    for live, rec in zip(like["embedding"]["tables"], emb["tables"], strict=True):
        param = rec["param"]
        online = None
        if live["online"] is not None:
            whole: list[ShardRecord] = [
                {"start": 0, "stop": live["online"]["stop"], "slots": rec["slots"]}
            ]
            online = {**load_ring(live["online"], whole, version), "t": rec["t"]}
        states.append(
            {
                "kind": "TableEngine",
                "schema_version": 1,
                "param": param,
                "plan": rec["plan"],
                "online": online,
            }
        )
        # not read yet: the table's engine reads it whole or in windows (`set_csc`)
        stored = rec["csc"]
        csc: StoredCSC | StoredParts | None = None
        if stored is not None and "parts" in stored:  # written by several ranks
            csc = StoredParts.of_version(version, param, dict(stored), rec["dim"])
        elif stored is not None:
            csc = StoredCSC.of_version(version, param)
        arrays.append(
            TableArrays(
                param=param,
                rows=rec["rows"],
                dim=rec["dim"],
                online_rows=rec["online_rows"],
                order=version.array(emb_name(param, "order")),
                csc=csc,
                precompute_seconds=float(rec.get("precompute_seconds", 0.0)),
                history_bytes=rec["history_bytes"],
            )
        )
    embedding = {
        "kind": "EmbeddingNoise",
        "schema_version": 1,
        "threat_model": emb["threat_model"],
        "tables": states,
    }
    return embedding, arrays
