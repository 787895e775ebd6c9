"""What a version holds, together: model, optimizer, sampler, accountant, ring, RNGs.

A snapshot copies the trainer's state into host memory (only the ring slots new since
the parent version); a background thread writes it and commits. At most one
checkpoint is in flight, so memory stays bounded by one snapshot.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import random
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cocoon_ckpt.dp.accountant import Accountant
from cocoon_ckpt.dp.noise import generator_backend
from cocoon_ckpt.train.distributed import DistContext
from cocoon_ckpt.train.noise_arrays import (
    load_ring,
    restore_tables,
    snapshot_ring,
    snapshot_tables,
    stored_table_plans,
)
from cocoon_ckpt.train.trainer import DPTrainer
from state import (
    ArrayMeta,
    CorruptVersionError,
    FormatVersionError,
    Manifest,
    Store,
    Transaction,
    Version,
    hooks,
)

__all__ = [
    "Checkpointer",
    "Snapshot",
    "model_state",
    "restore_trainer_state",
    "stored_table_plans",
]

log = logging.getLogger("cocoon_ckpt.train.checkpoint")

ASYNC_FLUSH = hooks.declare(
    "checkpoint.async_flush", "in the background writer, before it starts a version"
)


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
    records: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def take_snapshot(
    trainer: DPTrainer, parent: Manifest | None, extra_records: dict[str, Any]
) -> Snapshot:
    """Copy the trainer's state; ring slots the parent already holds are referenced.

    In a multi-process job every rank snapshots its own ring shard; only the
    coordinator snapshots the rest (parameters are the same on every rank)."""
    snap = Snapshot(step=trainer.step_index)
    shard_rec = snapshot_ring(trainer, parent, snap)
    if trainer.dist is not None and not trainer.dist.is_coordinator:
        snap.records["_shard"] = shard_rec
        return snap
    for name, t in trainer.model.state_dict().items():
        snap.arrays[f"model/{name}"] = _to_numpy(t)
    opt = trainer.optimizer.state_dict()
    opt_record: dict[str, Any] = {"param_groups": opt["param_groups"], "state": {}}
    for idx, st in opt["state"].items():
        rec: dict[str, Any] = {}
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                snap.arrays[f"optim/{idx}/{key}"] = _to_numpy(val)
                rec[key] = {"array": f"optim/{idx}/{key}"}
            else:
                rec[key] = {"value": val}
        opt_record["state"][str(idx)] = rec
    snap.arrays["rng/torch"] = _to_numpy(torch.get_rng_state())
    np_state = np.random.get_state()
    snap.arrays["rng/numpy"] = np.asarray(np_state[1])
    py_state = random.getstate()
    noise = trainer.noise
    if trainer.embedding is not None:
        snap.records["embedding"] = snapshot_tables(trainer, trainer.embedding, parent, snap)
    snap.records.update(
        {
            "trainer": {"step": trainer.step_index},
            "optimizer": opt_record,
            "sampler": trainer.sampler.state_dict(),
            "accountant": trainer.accountant.state_dict(with_epsilon=False),
            "mechanism": trainer.mechanism.state_dict(),
            "noise": {
                "t": noise.t,
                "dim": trainer.dim,
                "dtype": str(noise.dtype).removeprefix("torch."),
                "head": (noise.t % (trainer.mechanism.bands - 1))
                if trainer.mechanism.bands > 1
                else 0,
                # storage: whole-width slots per rank shard, whatever the placement,
                # so a resume on other tiers or another world size re-plans and
                # loads the same arrays
                "shards": [{k: shard_rec[k] for k in ("start", "stop", "slots")}],
                "placement": shard_rec["placement"],
                "plan": noise.history.plan,
                "history_bytes": noise.history_bytes(),
            },
            "generator": generator_backend(),
            "rng": {
                "numpy": {
                    "kind": np_state[0],
                    "pos": int(np_state[2]),
                    "has_gauss": int(np_state[3]),
                    "cached_gaussian": float(np_state[4]),
                },
                "python": [py_state[0], list(py_state[1]), py_state[2]],
            },
            "param_names": trainer.param_names,
            **extra_records,
        }
    )
    return snap


def model_state(version: Version) -> dict[str, torch.Tensor]:
    """The model state_dict held by a version (verified arrays, copied)."""
    return {
        name[len("model/") :]: torch.from_numpy(version.array(name).copy())
        for name in version.array_names()
        if name.startswith("model/")
    }


def restore_trainer_state(trainer: DPTrainer, version: Version) -> None:
    """Load a committed version into `trainer` (verified arrays, then every record)."""
    rec = version.records
    opt_state: dict[str, Any] = {"param_groups": rec["optimizer"]["param_groups"], "state": {}}
    for idx, st in rec["optimizer"]["state"].items():
        opt_state["state"][int(idx)] = {
            key: torch.from_numpy(version.array(v["array"]).copy()) if "array" in v else v["value"]
            for key, v in st.items()
        }
    nrec = rec["noise"]
    # any stored sharding (another world size) onto this rank's [start, stop)
    noise_state = {**load_ring(trainer.noise, nrec["shards"], version), "t": nrec["t"]}
    trainer.load_state_dict(
        {
            "kind": "DPTrainer",
            "schema_version": 1,
            "step": rec["trainer"]["step"],
            "model": model_state(version),
            "optimizer": opt_state,
            "noise": noise_state,
            "sampler": rec["sampler"],
            "accountant": rec["accountant"],
            "rng": {"torch": torch.from_numpy(version.array("rng/torch").copy())},
            "embedding": restore_tables(trainer, version),
        }
    )
    npr = rec["rng"]["numpy"]
    np.random.set_state(
        (
            npr["kind"],
            version.array("rng/numpy").copy(),
            npr["pos"],
            npr["has_gauss"],
            npr["cached_gaussian"],
        )
    )
    py = rec["rng"]["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def _lower_priority() -> None:
    """Run the background writer at nice 10 (Linux threads have their own nice), so
    the training threads keep the cores; what is written is unaffected."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class Checkpointer:
    """Writes versions of a trainer's state to a store, optionally in the background.

    Args:
        store: an open store whose lease this process holds.
        async_write: write in a background thread while training goes on.
        keep_last: retention after each commit (>= 2).
    """

    def __init__(self, store: Store, *, async_write: bool = True, keep_last: int = 3) -> None:
        self.store = store
        self.async_write = async_write
        self.keep_last = keep_last
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt", initializer=_lower_priority
        )
        self._inflight: concurrent.futures.Future[Manifest] | None = None
        self.last: Manifest | None = None
        self.bytes_written = 0

    @property
    def in_flight(self) -> bool:
        """A background checkpoint is being written now."""
        return self._inflight is not None and not self._inflight.done()

    def set_parent(self, manifest: Manifest | None) -> None:
        self.last = manifest

    def save(self, trainer: DPTrainer, extra_records: dict[str, Any]) -> None:
        """Snapshot now; write (in the background when async) and commit.

        In a multi-process job every rank calls this at the same step; the write is in
        the foreground (its collectives must not interleave with training's)."""
        self.wait()  # at most one in flight: bounded memory, ordered versions
        snap = take_snapshot(trainer, self.last, extra_records)
        if trainer.dist is not None:
            self._write_coordinated(snap, trainer.dist)
        elif self.async_write:
            self._inflight = self._pool.submit(self._write, snap)
        else:
            self._write(snap)

    def wait(self) -> Manifest | None:
        """Block until the in-flight checkpoint is committed; re-raise its error."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()
        return self.last

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _write_coordinated(self, snap: Snapshot, dist: DistContext) -> Manifest:
        """Every rank writes its arrays of version v (its own folder); after a barrier
        (the gather) the coordinator writes the manifest listing them all. A rank that
        dies before the gather leaves no manifest, so the previous version stays newest."""
        txn = self._begin(snap) if dist.is_coordinator else None
        head = dist.broadcast_object(
            (txn.version, txn.lease.generation) if txn is not None else None
        )
        shard = snap.records.pop("_shard", None)
        if txn is None:
            writer = self.store.shard_writer(head[0], snap.step, head[1], dist.rank)
            for name, arr in snap.arrays.items():
                writer.put_array(name, arr)
            mine = {**writer.finish(), **snap.references}
            written = writer.bytes_written
        else:
            mine, written = {}, 0
        gathered = dist.all_gather_object((mine, shard))
        manifest = None
        if txn is not None:
            noise = snap.records["noise"]
            for arrays, rec in gathered[1:]:
                for name, meta in arrays.items():
                    txn.reference(name, meta)
                noise["shards"].append({k: rec[k] for k in ("start", "stop", "slots")})
                noise["placement"] = noise["placement"] + rec["placement"]
            manifest = self._commit(txn, snap)
        manifest = dist.broadcast_object(manifest)
        self.bytes_written += written
        self.last = manifest
        return manifest  # type: ignore[no-any-return]

    def _write(self, snap: Snapshot) -> Manifest:
        hooks.point(ASYNC_FLUSH, step=snap.step)
        return self._commit(self._begin(snap), snap)

    def _begin(self, snap: Snapshot) -> Transaction:
        """The next version, child of the last committed one."""
        parent = self.last
        return self.store.begin(
            snap.step,
            parent=parent.version if parent else None,
            job_fingerprint=snap.records.get("fingerprint"),
        )

    def _commit(self, txn: Transaction, snap: Snapshot) -> Manifest:
        """Write this process's arrays into `txn`, then the records, and commit."""
        for name, arr in snap.arrays.items():
            txn.put_array(name, arr)
        for name, meta in snap.references.items():
            txn.reference(name, meta)
        # A fresh folder per write: a crash before the commit leaves an unreferenced
        # folder (never a half-written array a retry would collide with).
        token = secrets.token_hex(4)
        for name, arr in snap.shared.items():
            txn.reference(name, self.store.put_shared(f"{token}/{name}", arr))
        acc = snap.records.get("accountant")
        if acc is not None and acc.get("epsilon") is None:
            acc["epsilon"] = Accountant.from_state_dict(acc).epsilon()
        for name, rec in snap.records.items():
            txn.put_record(name, rec)
        manifest = txn.commit()
        self.bytes_written += txn.bytes_written
        self.last = manifest
        try:
            self.store.retain(keep_last=self.keep_last, newest_valid=manifest.version)
        except (CorruptVersionError, FormatVersionError) as exc:
            # The commit stands; only the clean-up is skipped, deleting nothing, until
            # the damaged version is repaired or retain(discard_damaged=True) is asked for.
            log.warning("version %d committed; retention skipped: %s", manifest.version, exc)
        log.info(
            "committed version %d at step %d (%d bytes)",
            manifest.version,
            snap.step,
            txn.bytes_written,
        )
        return manifest
